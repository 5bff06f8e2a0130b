"""Executors: how the engine core reaches its worker(s). One interface, several placements."""

from __future__ import annotations

from typing import Protocol

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.metrics.startup import StartupPhases


class Executor(Protocol):
    """What the engine core calls: in process (``uniproc``) or one process per rank (``multiproc``)."""

    @property
    def startup(self) -> StartupPhases: ...

    def determine_num_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...
