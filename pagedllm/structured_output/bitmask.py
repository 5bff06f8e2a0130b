"""Applying a step's grammar bitmask to the logits (torch; runs in the model runner)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch


def apply_grammar_bitmask(logits: torch.Tensor, grammar_bitmask: Any, sample_req_ids: list[str]) -> None:
    """Set to -inf, in place, every logit a constrained row's grammar does not allow.

    ``logits``: [len(sample_req_ids), V], one row per sampled request; ``grammar_bitmask``: a
    ``GrammarBitmask`` (or None) whose rows name their requests, all of which sample this step.
    Bit ``j`` of word ``i`` of a row allows token ``32 * i + j``.
    """
    if grammar_bitmask is None or not grammar_bitmask.req_ids:
        return
    row_of = {req_id: row for row, req_id in enumerate(sample_req_ids)}
    rows = [row_of[req_id] for req_id in grammar_bitmask.req_ids]
    if logits.device.type == "cpu":
        _apply_cpu(logits, grammar_bitmask.bitmask, rows)
        return
    kernel = _xgrammar_kernel()
    if kernel is None:
        apply_bitmask_torch(logits, grammar_bitmask.bitmask.to(logits.device), rows)
        return
    # xgrammar's CUDA/Triton kernel indexes logits and bitmask rows alike: spread ours out.
    full = torch.full((logits.shape[0], grammar_bitmask.bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = grammar_bitmask.bitmask
    kernel(logits, full.to(logits.device, non_blocking=True), indices=rows)


def _apply_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """numpy's table-driven unpackbits + one masked_fill: ~8x faster than xgrammar's CPU kernel
    on mostly-masked rows of a 49k vocabulary (1.5 vs 12 ms for 64 rows, 2 cores)."""
    vocab = logits.shape[1]
    disallowed = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    mask = torch.from_numpy(disallowed).view(torch.bool)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(mask, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill_(mask, float("-inf"))


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Reference implementation in plain torch (any device)."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


@functools.cache
def _xgrammar_kernel() -> Any:
    """xgrammar's GPU kernel (Triton/CUDA), imported on first use; None without xgrammar."""
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:  # pragma: no cover - xgrammar is a dependency
        return None
    return apply_token_bitmask_inplace
