"""Per-step batch description shared by every attention backend.

The model runner fills one of these per step; each backend turns it into its own metadata
once per step (not per layer). It travels explicitly through ``model.forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    """A flat variable-length batch: request i owns tokens query_start_loc[i]:query_start_loc[i+1]."""

    query_start_loc: torch.Tensor  # [B+1] int64 (CPU or device)
    query_start_loc_cpu: list[int]  # the same, as Python ints
    seq_lens: torch.Tensor  # [B] int64: computed context + this step's query tokens
    seq_lens_cpu: list[int]
    block_table: torch.Tensor  # [B, max_blocks] int64, padded with 0 (the null block)
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every new token
    block_size: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_actual_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    def query_lens_cpu(self) -> list[int]:
        loc = self.query_start_loc_cpu
        return [loc[i + 1] - loc[i] for i in range(len(loc) - 1)]


def build_common_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> CommonAttentionMetadata:
    """Build the metadata from plain lists (tests and simple callers; the runner has a faster path)."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    loc = [0]
    for n in query_lens:
        loc.append(loc[-1] + n)
    width = max((len(t) for t in block_tables), default=0) or 1
    table = torch.zeros(len(block_tables), width, dtype=torch.int64)
    for i, row in enumerate(block_tables):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    slots = []
    for i, (ctx, n) in enumerate(zip(context_lens, query_lens)):
        for pos in range(ctx, ctx + n):
            slots.append(block_tables[i][pos // block_size] * block_size + pos % block_size)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(loc, dtype=torch.int64, device=device),
        query_start_loc_cpu=loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        seq_lens_cpu=seq_lens,
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
