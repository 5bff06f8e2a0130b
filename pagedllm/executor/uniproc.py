"""Executor with the single worker in this process (world size 1)."""

from __future__ import annotations

import time

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.metrics.startup import StartupPhases


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        from pagedllm.worker.worker import Worker  # torch is only needed once an executor exists

        imported = time.perf_counter() - start
        self.worker = Worker(config)
        self.worker.startup.add("imports", imported)
        self.worker.load_model()

    @property
    def startup(self) -> StartupPhases:
        """The worker's start-up phases (kernels, weights, KV cache, ...)."""
        return self.worker.startup

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def check_health(self) -> None:
        """The worker is this process: alive while we are."""

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives and dies with this process."""
