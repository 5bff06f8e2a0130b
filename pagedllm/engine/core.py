"""EngineCore: the step loop — schedule, execute, update. Runs in-process or in its own process."""

from __future__ import annotations

import logging
import time

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import Scheduler
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
        self.executor = make_executor(config)
        phases = self.executor.startup
        with phases.phase("KV sizing"):  # CUDA: a profiling forward of the largest step
            self.num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(self.num_blocks)
        with phases.phase("scheduler"):
            self.scheduler = Scheduler(
                config.scheduler_config,
                config.cache_config,
                self.num_blocks,
                config.speculative_config,
                num_swap_blocks=config.num_swap_blocks(),
                max_loras=None if config.lora_config is None else config.lora_config.max_loras,
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
        req = Request.from_engine_core_request(request)
        self.structured_output_manager.grammar_init(req)  # compiles in the background
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every cached prefix block; False while requests hold blocks (see the scheduler's)."""
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
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        sched = self.scheduler.schedule()
        if sched.is_empty and self.scheduler.compiling:
            self.structured_output_manager.wait_for_compiles(self.scheduler.compiling, _COMPILE_WAIT_S)
        sched.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
            sched.structured_output_request_ids, self.scheduler.requests
        )
        runner_output = self.executor.execute_model(sched)
        return self.scheduler.update_from_output(sched, runner_output)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def check_health(self) -> None:
        """Between steps: raises if a worker rank (here or on another node) is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the executor's workers (a no-op in process)."""
        self.executor.shutdown()


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
