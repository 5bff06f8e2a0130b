"""The engine's intra-op thread count: the cores this process may use, or ``OMP_NUM_THREADS``.

torch sizes its pool from the machine's cores, which overshoots in a container with a CPU
quota (64 threads on a 2-CPU slice thrash) or under ``taskset``; ``cpu_info.usable_cpus()``
counts the affinity mask capped by the cgroup quota. A user's ``OMP_NUM_THREADS`` wins: torch
already honours it, so it is left alone.
"""

from __future__ import annotations

import logging

import torch

from pagedllm import cpu_info, envs

logger = logging.getLogger(__name__)


def intra_op_threads() -> tuple[int, str]:
    """The thread count the engine runs with and where it comes from."""
    omp = envs.omp_num_threads()
    if omp:
        return torch.get_num_threads(), f"OMP_NUM_THREADS={omp}"
    count = cpu_info.usable_cpus()
    return count, cpu_info.core_budget()[1]


def set_intra_op_threads() -> int:
    """Apply ``intra_op_threads()`` to torch (the worker calls this once at start) and log it."""
    count, source = intra_op_threads()
    if not envs.omp_num_threads():
        torch.set_num_threads(count)
    logger.info("intra-op threads: %d (%s)", count, source)
    return count
