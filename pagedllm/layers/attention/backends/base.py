"""The interface every attention backend implements (torch reference, Triton, ...)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.layers.attention.metadata import CommonAttentionMetadata
from pagedllm.layers.cpu_kernels import cpu_fp32_kernels

if TYPE_CHECKING:
    from pagedllm.layers.attention.layer import Attention


class AttentionBackend(ABC):
    """Writes new K/V through the slot mapping and attends over the paged cache."""

    name: str = "base"

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Once per step: turn the common description into what ``forward`` needs."""

    @abstractmethod
    def forward(self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: Any) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, KVH*D] for the new tokens; returns [T, H*D]."""


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows into the paged cache ``[2, num_blocks, block_size, KVH, D]``."""
    kernels = cpu_fp32_kernels(kv_cache)
    if kernels is not None and k.dtype == torch.float32:
        # One call instead of ~8 ops; rows are [T, KVH * D] (views of the fused qkv output).
        kernels.write_kv_cache(k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1), kv_cache, slot_mapping)
        return
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    key_cache.index_copy_(0, slot_mapping, k.view(-1, num_kv_heads, head_dim))
    value_cache.index_copy_(0, slot_mapping, v.view(-1, num_kv_heads, head_dim))
