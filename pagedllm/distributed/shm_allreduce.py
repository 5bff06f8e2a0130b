"""All-reduce through shared memory between the tensor-parallel ranks of one machine (CPU).

gloo's all-reduce costs about 0.3-0.5 ms even for a decode step's few KiB of hidden states, and a
step makes 2 x layers + 1 of them. Here each rank copies its tensor into its own slot of one
shared segment, publishes a sequence number, waits (spinning, yielding the core) until every
peer has published the same number, then sums the slots in rank order, so every rank gets
bit-identical results. Two slot sets alternate: a rank can only start op n + 1 after every peer
published op n, i.e. finished reading op n - 1, whose slots op n + 1 reuses.

The protocol is C++ (``csrc/cpu_shm_allreduce.cpp``, release/acquire on the flags), one
implementation for the calls made here and for those the decode stack makes between its layers
(``layers/cpu_decode_stack.py``); both advance the one op counter in ``state``, which also counts
the time spent in the ops and the bytes they carried (:meth:`ShmAllReduce.stats`). This class owns the
segment. It is used on x86-64 only (the platform it is tested on), with the CPU kernels built;
elsewhere, and for tensors larger than a slot, gloo runs. A peer that never publishes (dead, hung)
makes the wait raise after ``timeout_s``, naming it; the executor notices a dead rank sooner, from
its process sentinel. The segment is unlinked as soon as every rank has attached, so a killed group
leaves nothing in /dev/shm.
"""

from __future__ import annotations

import os
import platform
import uuid
from functools import cached_property
from multiprocessing import shared_memory
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.layers.cpu_kernels import cpu_ops, kernels_enabled

_FLAG_BYTES = 64  # one cache line per rank's sequence number (the C++ layout)
# Slot elements the C++ op sums exactly as torch.add would (the dtypes the model's collectives carry).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def supported() -> bool:
    """Whether the ranks of one machine can use it: x86-64, the CPU kernels not switched off."""
    return platform.machine() in ("x86_64", "AMD64") and kernels_enabled()


class ShmAllReduce:
    def __init__(self, rank: int, world_size: int, slot_bytes: int = 4 << 20, timeout_s: float = 60.0) -> None:
        self.rank, self.world_size, self.slot_bytes, self.timeout_s = rank, world_size, slot_bytes, timeout_s
        size = world_size * _FLAG_BYTES + 2 * world_size * slot_bytes
        names: list[str | None] = [f"pagedllm-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}" if rank == 0 else None]
        if rank == 0:
            self.shm = shared_memory.SharedMemory(name=names[0], create=True, size=size)
        dist.broadcast_object_list(names, src=0)
        if rank != 0:
            assert names[0] is not None
            self.shm = shared_memory.SharedMemory(name=names[0])
        dist.barrier()
        if rank == 0:
            # Every rank holds a mapping: nothing is left behind if we are killed. (Spawned ranks share
            # their parent's resource tracker, whose one entry for the name this also clears.)
            self.shm.unlink()
        self.segment = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        # Ops done so far, ns spent in them, bytes all-reduced, bytes all-gathered: the C++ ops
        # advance it, called from here or by the decode stack.
        self.state = torch.zeros(4, dtype=torch.int64)

    def stats(self) -> dict[str, int]:
        """This rank's counters since the group started (for benchmarks): ops, the nanoseconds spent
        in them (copy, wait for the peers, sum), and the bytes of its tensors all-reduced / gathered."""
        ops, ns, reduced, gathered = self.state.tolist()
        return {"ops": ops, "ns": ns, "bytes_reduced": reduced, "bytes_gathered": gathered}

    @cached_property
    def ops(self) -> Any | None:
        """The kernels holding the protocol; None if they did not build (every rank then uses gloo)."""
        return cpu_ops()

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.device.type == "cpu"
            and x.dtype in _DTYPES
            and x.numel() * x.element_size() <= self.slot_bytes
            and self.ops is not None
        )

    def args(self) -> tuple[torch.Tensor, torch.Tensor, int, int, int, float]:
        """The C++ ops' view of the group (after the tensor): segment, state, rank, size, slot size, timeout."""
        return self.segment, self.state, self.rank, self.world_size, self.slot_bytes, self.timeout_s

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (a new tensor)."""
        return self._op("shm_all_gather")(x, *self.args(), dim)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        self._op("shm_all_reduce_")(x, *self.args())
        return x

    def _op(self, name: str) -> Any:
        assert self.ops is not None, "callers check fits() first"
        return getattr(self.ops, name).default
