"""Attention backend on Triton kernels (the CUDA path; runs on CPU only under ``TRITON_INTERPRET=1``).

Per layer: one launch writes the new K/V through the slot mapping, one launch attends over the whole
mixed batch (prefill chunks on a cached prefix and decodes together); see
``layers/attention/ops/triton_paged_attention.py``. Nothing here synchronises with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.layers.attention.backends.base import AttentionBackend
from pagedllm.layers.attention.metadata import CommonAttentionMetadata
from pagedllm.layers.attention.ops.triton_paged_attention import paged_attention, reshape_and_cache


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, W] int32
    num_tokens: int
    max_query_len: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, tiles: tuple[int, int, int] | None = None) -> None:
        self.tiles = tiles  # (BLOCK_M, BLOCK_Q, TILE_N) override (tests, tuning); None: per step

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            slot_mapping=common.slot_mapping,
            query_start_loc=common.query_start_loc.to(torch.int32),
            seq_lens=common.seq_lens.to(torch.int32),
            block_table=common.block_table.to(torch.int32).contiguous(),
            num_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
        )

    def forward(self, layer, q, k, v, metadata: TritonAttentionMetadata) -> torch.Tensor:
        kv_cache = layer.kv_cache
        num_heads, num_kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        n = metadata.num_tokens
        key, value = k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
        reshape_and_cache(key[:n], value[:n], kv_cache[0], kv_cache[1], metadata.slot_mapping)
        query = q.view(-1, num_heads, head_dim)
        out = torch.empty_like(query)
        paged_attention(
            out,
            query,
            kv_cache[0],
            kv_cache[1],
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            n,
            metadata.max_query_len,
            layer.scale,
            layer.sliding_window,
            self.tiles,
        )
        return out.view(-1, num_heads * head_dim)
