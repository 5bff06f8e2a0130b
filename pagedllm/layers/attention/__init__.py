from pagedllm.layers.attention.layer import Attention
from pagedllm.layers.attention.metadata import CommonAttentionMetadata

__all__ = ["Attention", "CommonAttentionMetadata"]
