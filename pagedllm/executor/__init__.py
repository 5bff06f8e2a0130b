"""Executors: how the engine core reaches its worker(s). One interface, several placements."""

from __future__ import annotations

import os
import signal
from typing import Protocol

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.metrics.startup import StartupPhases


class WorkerDiedError(RuntimeError):
    """A worker process (a tensor-parallel rank or a pipeline stage) exited or stopped answering."""


class Executor(Protocol):
    """What the engine core calls: in process (``uniproc``), one process per rank (``multiproc``)
    or one Ray actor per rank (``ray_executor``)."""

    @property
    def startup(self) -> StartupPhases: ...

    def determine_num_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_health(self) -> None:
        """Between steps: raise if a rank is gone (the engine core's idle loop asks)."""
        ...

    def shutdown(self) -> None: ...


def die_with_parent(parent_pid: int) -> None:
    """A child's first act (engine core, tensor-parallel worker): on Linux, get SIGKILL when its
    parent thread dies (PR_SET_PDEATHSIG), and exit now if that parent is already gone."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:
        raise SystemExit(1)
