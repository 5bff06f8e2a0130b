"""EngineCore: the step loop — schedule, execute, update (with pipeline stages, up to one batch per
stage in flight: ``batch_queue.py``). Runs in-process or in its own process."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import cast

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step_plan import PipelineShape
from pagedllm.engine.batch_queue import BatchQueue, PipelinedExecutor
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from pagedllm.executor import Executor
from pagedllm.request import Request, RequestStatus
from pagedllm.structured_output.compiler import GrammarCompiler
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)
CAPACITY_PROBE_TOKENS = 1024  # the capacity line also says how many sequences of this length fit

_COMPILE_WAIT_S = 0.01  # idle wait for a grammar when compiling requests are all there is


class EngineCore:
    """Owns the scheduler (and through it the KV manager) and the executor."""

    def __init__(self, config: EngineConfig, grammar_compiler: GrammarCompiler | None = None) -> None:
        """``grammar_compiler``: share the front end's (in-process engines) so a constraint the
        front end checked is not compiled twice."""
        start = time.perf_counter()
        self.config = config
        pipeline = pipeline_shape(config)  # before any worker starts: it checks an env setting
        self.executor = make_executor(config)
        phases = self.executor.startup
        with phases.phase("KV sizing"):  # CUDA: a profiling forward of the largest step
            self.num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(self.num_blocks)
        # Pipeline stages: up to one batch per stage in flight (None: one step at a time).
        self.batch_queue: BatchQueue | None = None
        if pipeline.max_batches_in_flight > 1:
            self.batch_queue = BatchQueue(cast(PipelinedExecutor, self.executor), pipeline.max_batches_in_flight)
        self._held: deque[EngineCoreOutputs] = deque()  # outputs of batches collected out of turn
        with phases.phase("scheduler"):
            self.scheduler = Scheduler(
                config.scheduler_config,
                config.cache_config,
                self.num_blocks,
                config.speculative_config,
                num_swap_blocks=config.num_swap_blocks(),
                max_loras=None if config.lora_config is None else config.lora_config.max_loras,
                pipeline=pipeline,
            )
            self.structured_output_manager = StructuredOutputManager(config, grammar_compiler)
        self.startup_seconds = time.perf_counter() - start
        self.startup_phases = dict(phases.seconds)
        logger.info("engine ready in %.1f s (%s): %s", self.startup_seconds, phases.summary(), self.capacity_summary())

    def capacity_summary(self) -> str:
        bs = self.config.cache_config.block_size
        usable = self.num_blocks - 1
        per_req = self.config.blocks_per_max_len_request()
        kv_gib = usable * self.config.kv_bytes_per_block() / (1 << 30)
        per_1k = -(-CAPACITY_PROBE_TOKENS // bs)
        return (
            f"{usable} KV blocks of {bs} tokens = {usable * bs} tokens ({kv_gib:.3g} GiB); "
            f"{usable // per_req} requests of max_model_len={self.config.model_config.max_model_len} fit "
            f"({usable // per_1k} of {CAPACITY_PROBE_TOKENS} tokens)" + self._swap_summary()
        )

    def _swap_summary(self) -> str:
        num_slots = self.config.num_swap_blocks()
        where = "pinned host memory" if self.config.device == "cuda" else "a memory-mapped temp file"
        return f"; swap tier: {num_slots} blocks in {where}" if num_slots else ""

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.scheduler.requests:
            # An aborted request of that id still has a batch in flight: let it come back first.
            self._drain()
        req = Request.from_engine_core_request(request)
        self.structured_output_manager.grammar_init(req)  # compiles in the background
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Requests to schedule, batches in flight, or outputs not handed over yet."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue) or bool(self._held)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every cached prefix block; False while requests hold blocks (see the scheduler's)."""
        self._drain()  # preempting needs every running request back from the workers
        done = self.scheduler.reset_prefix_cache(reset_running_requests)
        if not done:
            logger.warning(
                "prefix cache not reset: %d running requests hold KV blocks (reset_running_requests "
                "preempts them first)",
                len(self.scheduler.running),
            )
        return done

    def step(self) -> EngineCoreOutputs:
        """One iteration: plan, run the model, apply the results."""
        if self.batch_queue is not None:
            return self._step_pipelined(self.batch_queue)
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        sched = self._schedule(idle=True)
        runner_output = self.executor.execute_model(sched)
        return self.scheduler.update_from_output(sched, runner_output)

    def _schedule(self, idle: bool) -> SchedulerOutput:
        """The next step's plan with its grammar bitmask. ``idle``: no batch is in flight, so a
        step with nothing to run may wait a moment for a grammar being compiled."""
        sched = self.scheduler.schedule()
        if sched.is_empty and self.scheduler.compiling and idle:
            self.structured_output_manager.wait_for_compiles(self.scheduler.compiling, _COMPILE_WAIT_S)
        sched.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
            sched.structured_output_request_ids, self.scheduler.requests
        )
        return sched

    def _step_pipelined(self, queue: BatchQueue) -> EngineCoreOutputs:
        """Submit a batch while there is room and something to run; wait for the oldest when the
        queue is full or nothing new can run (its requests' next tokens are what is missing)."""
        if self._held:
            return self._held.popleft()
        submitted = False
        if not queue.is_full and self.scheduler.has_unfinished_requests():
            sched = self._schedule(idle=not queue)
            # An empty plan still goes when the workers must see it (or nothing else would run).
            if not sched.is_empty or sched.has_side_effects or not queue:
                queue.submit(sched)
                submitted = not sched.is_empty
        if queue and (queue.is_full or not submitted):
            return self.scheduler.update_from_output(*queue.pop_oldest())
        if submitted:
            return EngineCoreOutputs()
        return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())

    def _drain(self) -> None:
        """Wait for every batch in flight; their outputs go out with the next steps."""
        while self.batch_queue:
            self._held.append(self.scheduler.update_from_output(*self.batch_queue.pop_oldest()))

    def check_integrity(self) -> None:
        """The scheduler's and block pool's invariants, once every batch in flight is back."""
        self._drain()
        self.scheduler.check_integrity()

    def check_health(self) -> None:
        """Between steps: raises if a worker rank (here or on another node) is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the executor's workers (a no-op in process)."""
        self.executor.shutdown()


def pipeline_shape(config: EngineConfig) -> PipelineShape:
    """The pipeline stages and how many batches run at once (one per stage unless
    ``PAGEDLLM_PP_BATCHES_IN_FLIGHT`` says fewer)."""
    stages = config.parallel_config.pipeline_parallel_size
    return PipelineShape(stages, envs.pp_batches_in_flight(stages) if stages > 1 else 1)


def make_executor(config: EngineConfig) -> Executor:
    """In process for one rank; one worker process per rank for tensor or pipeline parallelism; one
    Ray actor per rank (tensor parallelism, any size) when the Ray backend is asked for."""
    parallel = config.parallel_config
    if parallel.distributed_executor_backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        from pagedllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from pagedllm.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
