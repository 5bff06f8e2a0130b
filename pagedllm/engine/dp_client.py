"""Data parallelism: ``data_parallel_size`` engine-core processes behind one front end.

Each core is a full engine (scheduler, KV cache, executor) reached through its own
``AsyncMPClient`` (its own ZMQ sockets, ipc directory, death handling). This client routes each
request to one core (``DPRouter``: least loaded, with prefix-cache affinity), sends an abort to
the core that owns the request, and merges every core's outputs into the one stream
``AsyncLLM`` reads, each stamped with its ``engine_index`` (for the per-engine metrics). The
cores report their load in every step's ``SchedulerStats``.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from typing import Any

import zmq
import zmq.asyncio

from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import AsyncMPClient
from pagedllm.engine.dp_router import DPRouter
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from pagedllm.sampling_params import StructuredOutputsParams


class DPAsyncMPClient:
    """The ``AsyncMPClient`` interface over several engine cores."""

    def __init__(self, config: EngineConfig) -> None:
        num_engines = config.parallel_config.data_parallel_size
        self.clients: list[AsyncMPClient] = []
        try:  # spawn them all (from this thread: PR_SET_PDEATHSIG), then wait: they start in parallel
            for index in range(num_engines):
                self.clients.append(AsyncMPClient(config, index, wait=False))
            for client in self.clients:
                client.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        cache = config.cache_config
        self.router = DPRouter(num_engines, cache.block_size if cache.enable_prefix_caching else None)
        self.capacity = _merged_capacity([c.capacity for c in self.clients])
        self._owner: dict[str, int] = {}  # request id -> its core, until it finishes or is aborted
        self._ready: deque[EngineCoreOutputs] = deque()
        self._poller = zmq.asyncio.Poller()
        self._index_of: dict[Any, int] = {}
        for client in self.clients:
            self._poller.register(client.output, zmq.POLLIN)
            self._index_of[client.output] = client.engine_index

    @property
    def is_alive(self) -> bool:
        """All cores are alive: one dead core takes the server down (its requests are lost)."""
        return all(c.is_alive for c in self.clients)

    def death_summary(self) -> str:
        dead = [c for c in self.clients if not c.is_alive]
        return "; ".join(
            f"engine core {c.engine_index} of {len(self.clients)} died (exit code {c.proc.exitcode})" for c in dead
        )

    def engine_of(self, request_id: str) -> int:
        return self._owner.get(request_id, 0)

    # ------------------------------------------------------------------ requests
    async def add_request(self, request: EngineCoreRequest) -> None:
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        index = self.router.route(request.prompt_token_ids, request.cache_salt, lora)
        self._owner[request.request_id] = index
        await self.clients[index].add_request(request)

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Each abort to the core that runs the request; ids no core runs (finished) are dropped."""
        by_engine: dict[int, list[str]] = defaultdict(list)
        for request_id in request_ids:
            index = self._owner.pop(request_id, None)
            if index is not None:
                by_engine[index].append(request_id)
        for index, ids in by_engine.items():
            await self.clients[index].abort_requests(ids)

    async def check_grammar(self, params: StructuredOutputsParams) -> None:
        """Checked on the least-loaded core (where the request will likely run); another core
        that gets the request compiles it again there, off its step loop."""
        await self.clients[self.router.least_loaded()].check_grammar(params)

    async def call_utility(self, name: str, *args: Any) -> Any:
        """On every core. bool results are and-ed (integrity, prefix-cache reset); others come
        back as a list, one per core."""
        results = await asyncio.gather(*(c.call_utility(name, *args) for c in self.clients))
        return all(results) if all(isinstance(r, bool) for r in results) else results

    # ------------------------------------------------------------------ outputs
    async def get_output(self, timeout: float) -> EngineCoreOutputs | None:
        """The next step's outputs of any core, or None when nothing arrived within ``timeout``."""
        if not self._ready:
            for sock, _ in await self._poller.poll(int(timeout * 1000)):
                await self._drain(self._index_of[sock])
        return self._ready.popleft() if self._ready else None

    async def _drain(self, index: int) -> None:
        """Take every message the core has sent (a utility reply resolves its call on the way)."""
        while (outputs := await self.clients[index].get_output(0)) is not None:
            outputs.engine_index = index
            self._observe(index, outputs)
            self._ready.append(outputs)

    def _observe(self, index: int, outputs: EngineCoreOutputs) -> None:
        stats = outputs.scheduler_stats
        if stats is not None:
            self.router.report(index, stats.num_running_reqs, stats.num_waiting_reqs)
        for out in outputs.outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)

    def fail_pending_calls(self, error: Exception) -> None:
        for client in self.clients:
            client.fail_pending_calls(error)

    def shutdown(self, timeout: float = 5.0) -> None:
        """SIGTERM every core first (they stop in parallel), then wait for each."""
        for client in self.clients:
            if client.proc.is_alive():
                client.proc.terminate()
        for client in self.clients:
            client.shutdown(timeout)


def _merged_capacity(capacities: list[dict]) -> dict:
    """The start-up banner's view: every core has the same pool (one config); the slowest start."""
    first = capacities[0]
    slowest = max(capacities, key=lambda c: c["startup_seconds"])
    return {
        **first,
        "summary": f"{len(capacities)} data-parallel engine cores, each: {first['summary']}",
        "startup_seconds": slowest["startup_seconds"],
        "startup_phases": slowest["startup_phases"],
        "engines": capacities,
    }
