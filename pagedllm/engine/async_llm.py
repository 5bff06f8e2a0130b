"""AsyncLLM: the asyncio front end used by the server. The engine core runs in another process.

``generate()`` is an async generator of ``RequestOutput``s for one request. An output-handler
task pulls each step's outputs from the engine process, detokenizes them (stop strings
included) and puts them on the per-request queues. Nothing here blocks the event loop on
model work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core_client import AsyncMPClient, EngineDeadError
from pagedllm.engine.dp_client import DPAsyncMPClient
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.protocol import SchedulerStats
from pagedllm.engine.tokenizer import load_tokenizer
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.startup import StartupPhases
from pagedllm.metrics.stats import IterationStats, IterationStatsTracker, StatLogger
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_POLL_S = 0.2  # how often the output handler checks that the engine process is alive


class AsyncLLM:
    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None) -> None:
        self.config = config
        self.startup = StartupPhases()
        self.client, self.tokenizer = self._start(config)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats_tracker = IterationStatsTracker()
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        for stat_logger in self.stat_loggers:
            stat_logger.log_engine_initialized(config, self.client.capacity["num_blocks"])
        self.dead_error: EngineDeadError | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._output_task: asyncio.Task | None = None

    def _start(self, config: EngineConfig) -> tuple[AsyncMPClient | DPAsyncMPClient, Any]:
        """Start the engine process(es) and load the tokenizer meanwhile (on a thread: the engine's
        start-up is spent in its own process, this one only waits for it)."""
        mc = config.model_config
        with ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenizer") as pool:
            start = time.perf_counter()
            tokenizer = pool.submit(load_tokenizer, mc.tokenizer, mc.trust_remote_code)
            tokenizer.add_done_callback(lambda _: self.startup.add("tokenizer", time.perf_counter() - start))
            with self.startup.phase("engine process"):
                client = make_core_client(config)
            try:
                return client, tokenizer.result()
            except BaseException:
                client.shutdown()
                raise

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(args.create_engine_config(), **kwargs)

    @property
    def capacity(self) -> dict:
        return self.client.capacity

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and self.client.is_alive

    # ------------------------------------------------------------------ requests
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        strict_max_tokens: bool = True,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs for one request. Cancelling the consumer aborts the request. ``tenant``:
        who sent it (an API key's name); the engine's waiting queue serves tenants in turn."""
        queue = await self.add_request(
            request_id, prompt, sampling_params, priority, cache_salt, strict_max_tokens, lora_request, tenant
        )
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                _raise_engine_error(item)
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        priority: int = 0,
        tenant: str | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Embed one prompt: yields its one ``PoolingRequestOutput``. Cancelling the consumer
        aborts the request; a request the engine could not serve raises ValueError."""
        self._check_alive()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        request, text = self.input_processor.process_pooling(
            request_id, prompt, pooling_params, priority=priority, tenant=tenant
        )
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._ensure_output_task()
        self.output_processor.add_request(request, text, queue=queue)
        self.stats_tracker.add_requests([request])
        finished = False
        try:
            await self.client.add_request(request)
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            finished = True
            if item.error is not None:
                raise ValueError(item.error)
            yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        strict_max_tokens: bool = True,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> asyncio.Queue:
        """Validate (raises ValueError), then queue the request in the engine."""
        self._check_alive()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        request, text = self.input_processor.process(
            request_id,
            prompt,
            params,
            priority=priority,
            cache_salt=cache_salt,
            strict_max_tokens=strict_max_tokens,
            check_grammar=False,
            lora_request=lora_request,
            tenant=tenant,
        )
        await self.check_structured_outputs(params)
        if request_id in self._queues:  # taken while the grammar compiled
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._ensure_output_task()
        children = self.output_processor.fan_out(request, text, queue=queue)
        self.stats_tracker.add_requests(children)
        try:
            for child in children:
                await self.client.add_request(child)
        except BaseException:  # cancelled mid fan-out: children already sent must not run on
            self._queues.pop(request_id, None)
            await asyncio.shield(self.abort(request_id))
            raise
        return queue

    def check_lora(self, lora_request: LoRARequest) -> None:
        """ValueError naming the adapter unless it fits the base model and the LoRA settings."""
        self.input_processor.check_lora(lora_request)

    async def check_structured_outputs(self, params: SamplingParams) -> None:
        """Have the engine process compile the request's constraint (its one compile: the engine
        keeps it for the request); ValueError if it is invalid or too slow to compile."""
        if params.structured_outputs is not None:
            self._check_alive()
            self._ensure_output_task()  # the verdict comes back with the outputs
            await self.client.check_grammar(params.structured_outputs)

    async def abort(self, request_id: str) -> None:
        """Abort a request (and its children): its KV blocks return to the pool at once."""
        core_ids = self.output_processor.abort_requests([request_id])
        now = time.monotonic()
        by_engine: dict[int, IterationStats] = {}
        for core_id in core_ids:
            iteration = by_engine.setdefault(self.client.engine_of(core_id), IterationStats())
            self.stats_tracker.finish(core_id, "abort", now, iteration)
        for engine, iteration in by_engine.items():
            self._record(None, iteration, engine)
        if self.is_running:
            await self.client.abort_requests(core_ids)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if not self.client.is_alive:
            self._mark_dead()
            assert self.dead_error is not None  # _mark_dead sets it
            raise self.dead_error

    # ------------------------------------------------------------------ output handling
    def _ensure_output_task(self) -> None:
        if self._output_task is None or self._output_task.done():
            self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

    async def _output_loop(self) -> None:
        try:
            while True:
                outputs = await self.client.get_output(timeout=_POLL_S)
                if outputs is None:
                    if not self.client.is_alive:
                        self._mark_dead()
                        return
                    continue
                await self._handle_outputs(outputs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave clients hanging forever
            logger.exception("output handler failed")
            self._mark_dead(exc)

    async def _handle_outputs(self, outputs) -> None:
        iteration = self.stats_tracker.observe(outputs)
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            now = time.monotonic()
            for req_id in processed.reqs_to_abort:
                self.stats_tracker.finish(req_id, "stop", now, iteration)
            await self.client.abort_requests(processed.reqs_to_abort)
        self._record(outputs.scheduler_stats, iteration, outputs.engine_index)

    def _record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats, engine: int = 0) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record(scheduler_stats, iteration, engine)

    def _mark_dead(self, cause: Exception | None = None) -> None:
        """The engine is gone: every waiting client gets an error now, not a hang."""
        if self.dead_error is None:
            self.dead_error = EngineDeadError(self.client.death_summary() + (f": {cause}" if cause else ""))
            logger.error("%s", self.dead_error)
        for queue in self._queues.values():
            queue.put_nowait(self.dead_error)
        self.client.fail_pending_calls(self.dead_error)

    # ------------------------------------------------------------------ misc
    async def check_health(self) -> None:
        """Raise EngineDeadError unless the engine process answers."""
        self._check_alive()
        self._ensure_output_task()
        await asyncio.wait_for(self.client.call_utility("ping"), timeout=5.0)

    async def call_utility(self, name: str, *args: Any) -> Any:
        self._check_alive()
        self._ensure_output_task()
        return await self.client.call_utility(name, *args)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every cached prefix block in the engine process (a utility call between steps);
        False while requests hold blocks, unless ``reset_running_requests`` preempts them first."""
        return bool(await self.call_utility("reset_prefix_cache", reset_running_requests))

    def get_num_unfinished_requests(self) -> int:
        return len(self._queues)

    def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        self.client.shutdown()


def make_core_client(config: EngineConfig) -> AsyncMPClient | DPAsyncMPClient:
    """One engine-core process, or ``data_parallel_size`` of them behind one routing client."""
    if config.parallel_config.data_parallel_size > 1:
        return DPAsyncMPClient(config)
    return AsyncMPClient(config)


def _raise_engine_error(output: RequestOutput) -> None:
    """A request the engine could not serve (e.g. its grammar failed to compile there) is the
    client's error: raise it as ValueError (a 400 on the server)."""
    for completion in output.outputs:
        if completion.finish_reason == "error":
            raise ValueError(str(completion.stop_reason or "the engine could not serve this request"))
