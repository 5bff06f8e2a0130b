"""The tensor-parallel group and its collectives; identity at world size 1.

Only the parallel layers (``pagedllm.layers.linear`` / ``embedding``) call these, so model files
never know about tensor parallelism. Without an initialised ``torch.distributed`` the rank is 0
and the size 1, which is what tests and single-device runs get.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# None means "the default (world) group" once torch.distributed is initialised.
_TP_GROUP: dist.ProcessGroup | None = None


def set_tp_group(group: dist.ProcessGroup | None) -> None:
    """Use ``group`` for tensor parallelism (the world group when None). Call before building a model."""
    global _TP_GROUP
    _TP_GROUP = group


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_tp_rank() -> int:
    return dist.get_rank(_TP_GROUP) if _distributed() else 0


def get_tp_size() -> int:
    return dist.get_world_size(_TP_GROUP) if _distributed() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group, in place; returns it."""
    if get_tp_size() > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    size = get_tp_size()
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
