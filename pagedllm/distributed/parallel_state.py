"""The tensor-parallel group: the one place that knows this rank's place in it.

Layers ask :func:`get_tp_group` once, at construction, and keep the answer: the parallel linears
and the vocab-parallel embedding / LM head size their shard from ``rank`` / ``size`` and call its
collectives in ``forward``. Model files never see it. Without an initialised ``torch.distributed``
(tests, single-device runs) the group is rank 0 of 1 and its collectives are the identity; with
one, and nothing installed, it is the default (world) group. :func:`set_tp_group` installs a group
explicitly (a worker that splits the world into TP x PP groups; tests that build one rank's layers
with a simulated group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from pagedllm.distributed.shm_allreduce import ShmAllReduce


@dataclass(frozen=True)
class TPGroup:
    """This rank's index in a tensor-parallel group of ``size`` ranks, and the group's collectives."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: torch.distributed's default group
    # Ranks on one machine (CPU): all-reduce through shared memory (distributed/shm_allreduce.py).
    shm: ShmAllReduce | None = None

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, f"rank {self.rank} outside a group of {self.size}"

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup | None = None) -> TPGroup:
        """The group over ``group``'s ranks (the world group when None); needs torch.distributed."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns it."""
        if self.size > 1:
            if self.shm is not None and self.shm.fits(x):
                return self.shm.all_reduce(x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather(x, dim)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


_SINGLE = TPGroup()
_TP_GROUP: TPGroup | None = None


def set_tp_group(group: TPGroup | None) -> None:
    """Install ``group`` for the layers built from now on; None: derive it from torch.distributed."""
    global _TP_GROUP
    _TP_GROUP = group


def get_tp_group() -> TPGroup:
    """The installed group, else the world group of an initialised torch.distributed, else rank 0 of 1."""
    if _TP_GROUP is not None:
        return _TP_GROUP
    if dist.is_available() and dist.is_initialized():
        return TPGroup.from_process_group()
    return _SINGLE
