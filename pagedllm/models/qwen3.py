"""Qwen3: Llama with RMSNorm on every query and key head before RoPE (QK-norm).

Qwen3 also sets ``head_dim`` explicitly (e.g. 128 with hidden 1024 and 16 heads, so
heads * head_dim != hidden); ``ModelArchConfig.head_dim`` carries it and the Llama blocks use it.
"""

from __future__ import annotations

import torch

from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.model_arch import ModelArchConfig
from pagedllm.models.llama import LlamaAttention, LlamaEmbeddingModel, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rotary_emb)
        # One weight vector over head_dim, shared by all heads (not over the full q width).
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q_norm(q.view(q.shape[0], -1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.view(k.shape[0], -1, self.head_dim)).view(k.shape)
        return q, k


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention


class Qwen3EmbeddingModel(LlamaEmbeddingModel):
    """HF ``Qwen3Model``: the Qwen3 body without an LM head (for pooling)."""

    attention_cls = Qwen3Attention
