"""The batches a pipeline keeps in flight (vLLM v1's batch queue).

With pipeline stages, one batch at a time leaves every stage but one idle. The engine core
instead submits a step without waiting for it, up to one batch per stage: while the last stage
runs batch i, the first runs batch i+1, which holds other requests (the scheduler never
schedules a request whose previous step has not come back, and splits the requests between the
batches in flight). Results come back in submission order (each stage runs its batches in
order), so a batch's outputs are applied after every earlier one's.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput


class PendingStep(Protocol):
    """A submitted step: ``result()`` waits for its output (oldest first)."""

    def result(self) -> ModelRunnerOutput: ...


class PipelinedExecutor(Protocol):
    def submit_model(self, sched: SchedulerOutput) -> PendingStep: ...


class BatchQueue:
    """Up to ``max_in_flight`` submitted steps, oldest first."""

    def __init__(self, executor: PipelinedExecutor, max_in_flight: int) -> None:
        self.executor = executor
        self.max_in_flight = max_in_flight
        self.steps: deque[tuple[SchedulerOutput, PendingStep]] = deque()
        self.peak = 0  # the most batches ever in flight at once (tests, metrics)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def is_full(self) -> bool:
        return len(self.steps) >= self.max_in_flight

    def submit(self, sched: SchedulerOutput) -> None:
        self.steps.append((sched, self.executor.submit_model(sched)))
        self.peak = max(self.peak, len(self.steps))

    def pop_oldest(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Wait for the oldest batch; its plan and its output."""
        sched, pending = self.steps.popleft()
        return sched, pending.result()
