"""Qwen2: Llama with a bias on the q/k/v projections (and none on o_proj).

Qwen2's optional sliding window (``use_sliding_window`` / ``max_window_layers``) is resolved per
layer by the config normaliser, so the Llama attention already honours it.
"""

from __future__ import annotations

from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.model_arch import ModelArchConfig
from pagedllm.models.llama import LlamaAttention, LlamaEmbeddingModel, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    def __init__(self, config: ModelArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        # Qwen2 always has q/k/v biases, whatever config.attention_bias says.
        super().__init__(config, layer_idx, rotary_emb, qkv_bias=True, o_bias=False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention


class Qwen2EmbeddingModel(LlamaEmbeddingModel):
    """HF ``Qwen2Model``: the Qwen2 body without an LM head (for pooling)."""

    attention_cls = Qwen2Attention
