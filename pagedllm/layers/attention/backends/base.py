"""The interface every attention backend implements (torch reference, Triton, ...)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.layers.attention.metadata import CommonAttentionMetadata

if TYPE_CHECKING:
    from pagedllm.layers.attention.layer import Attention


class AttentionBackend(ABC):
    """Writes new K/V through the slot mapping and attends over the paged cache."""

    name: str = "base"

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Once per step: turn the common description into what ``forward`` needs."""

    @abstractmethod
    def forward(
        self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, KVH*D] for the new tokens; returns [T, H*D]."""


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows into the paged cache ``[2, num_blocks, block_size, KVH, D]``, converted
    to the cache's dtype (a 16-bit cache under a float32 model: --kv-cache-dtype): the torch
    reference any backend may use (the torch backend's CPU kernel replaces it there)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    key_cache.index_copy_(0, slot_mapping, k.view(-1, num_kv_heads, head_dim).to(kv_cache.dtype))
    value_cache.index_copy_(0, slot_mapping, v.view(-1, num_kv_heads, head_dim).to(kv_cache.dtype))
