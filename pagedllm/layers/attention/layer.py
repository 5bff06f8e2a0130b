"""The attention layer that model files use; the backend does the paged-cache work."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.layers.attention.backends.base import AttentionBackend


class Attention(nn.Module):
    """Paged attention over this layer's KV cache ``[2, num_blocks, block_size, KVH, D]``.

    The model runner binds the cache tensor and the backend after the KV pool is sized
    (:meth:`bind_kv_cache`); until then the layer cannot run.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.layer_idx = layer_idx
        self.kv_cache: torch.Tensor | None = None
        # kv_cache[0] and kv_cache[1], taken once: indexing per step costs microseconds per layer.
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor, backend: AttentionBackend) -> None:
        self.kv_cache = kv_cache
        self.key_cache, self.value_cache = kv_cache[0], kv_cache[1]
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        """q: [T, H*D]; k, v: [T, KVH*D]; ``attn_metadata`` comes from ``backend.build_metadata``."""
        assert self.backend is not None and self.kv_cache is not None, "KV cache not bound"
        return self.backend.forward(self, q, k, v, attn_metadata)
