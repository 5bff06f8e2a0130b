"""The index math of a flat variable-length batch, and turning its arrays into device tensors.

A step runs ``counts[i]`` tokens of request i from position ``starts[i]`` on; everything the
forward needs (positions, slot mapping, query offsets, sequence lengths) follows from those two
vectors and the block table, computed here with numpy (no per-token Python). The persistent
batch (``input_batch.InputBatch``) and one-off batches (a draft model's proposal forwards, the
memory-profiling forward) share it.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from pagedllm.layers.attention.metadata import CommonAttentionMetadata
from pagedllm.worker.staging import HostStager


def index_arrays(
    counts: np.ndarray,
    starts: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(every per-step index array but the token ids, the request row of each token), int64."""
    cu = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    req_of_token = np.repeat(np.arange(len(counts)), counts)
    positions = starts[req_of_token] + np.arange(cu[-1]) - cu[:-1][req_of_token]
    arrays = {
        "positions": positions,
        "query_start_loc": cu,
        "seq_lens": starts + counts,
        "block_table": block_table,
        "slot_mapping": block_table[req_of_token, positions // block_size] * block_size + positions % block_size,
    }
    return arrays, req_of_token


def flat_batch_arrays(
    tokens: list[list[int]], starts: list[int], block_ids: list[list[int]], block_size: int
) -> dict[str, np.ndarray]:
    """The host (numpy) side of :func:`build_flat_batch`: every per-step index array, int64."""
    counts = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
    arrays, _ = index_arrays(counts, np.asarray(starts, dtype=np.int64), block_table(block_ids), block_size)
    arrays["input_ids"] = np.fromiter(itertools.chain.from_iterable(tokens), dtype=np.int64, count=int(counts.sum()))
    return arrays


def build_flat_batch(
    tokens: list[list[int]],
    starts: list[int],
    block_ids: list[list[int]],
    block_size: int,
    device: torch.device,
    stager: HostStager | None = None,
) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
    """(input_ids, positions, attention metadata) for requests that each run ``tokens[i]`` from
    position ``starts[i]`` on, writing KV through their block tables (one-off batches: a draft
    model's proposal forwards, the profiling forward)."""
    arrays = flat_batch_arrays(tokens, starts, block_ids, block_size)
    return batch_tensors(arrays, (stager or HostStager(device)).stage(arrays), block_size)


def batch_tensors(
    arrays: dict[str, np.ndarray],
    staged: dict[str, torch.Tensor],
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
    """(input_ids, positions, metadata) from the staged tensors; the Python-int fields from the host arrays."""
    loc, seq_lens = arrays["query_start_loc"].tolist(), arrays["seq_lens"].tolist()
    attn = CommonAttentionMetadata(
        query_start_loc=staged["query_start_loc"],
        query_start_loc_cpu=loc,
        seq_lens=staged["seq_lens"],
        seq_lens_cpu=seq_lens,
        block_table=staged["block_table"],
        slot_mapping=staged["slot_mapping"],
        block_size=block_size,
        # On the lists: numpy's diff and max cost ~25 us a step at batch 1 on cold caches.
        max_query_len=max(end - start for start, end in zip(loc, loc[1:])),
        max_seq_len=max(seq_lens),
    )
    return staged["input_ids"], staged["positions"], attn


def block_table(block_ids: list[list[int]]) -> np.ndarray:
    """Ragged block id lists as one [rows, widest] int64 table padded with 0 (the null block)."""
    width = max(len(ids) for ids in block_ids)
    table = np.zeros((len(block_ids), width), dtype=np.int64)
    for i, ids in enumerate(block_ids):
        table[i, : len(ids)] = ids
    return table
