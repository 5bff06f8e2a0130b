"""Per-iteration statistics the front end derives from engine outputs, and the logger interface."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pagedllm.engine.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
    SpecDecodingStats,
)

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass
class ScheduledTiming:
    """Engine-core interval of a request that was scheduled (seconds)."""

    queued_time: float  # queued -> first scheduled


@dataclass
class CompletedTiming(ScheduledTiming):
    """The intervals of a request that produced at least one token (seconds). A preemption's
    recompute counts in the phase it interrupted, as in vLLM."""

    prefill_time: float  # first scheduled -> first token
    decode_time: float  # first token -> last token
    inference_time: float  # first scheduled -> last token
    mean_time_per_output_token: float | None  # decode time per token after the first; None for one token


@dataclass
class FinishedRequestStats:
    finish_reason: str  # stop | length | abort | error
    e2e_latency: float  # seconds from arrival to the last output
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None = None  # the request's max_tokens
    num_cached_tokens: int = 0  # prompt tokens its prefill found in the prefix cache
    timing: ScheduledTiming | None = None  # None: never scheduled (or aborted before any output)


@dataclass
class IterationStats:
    """What one engine step produced, as seen by the front end."""

    num_prompt_tokens: int = 0  # prompts whose first output token arrived this step
    num_cached_prompt_tokens: int = 0  # of those, served from the prefix cache
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # One entry per user request whose last sequence finished (n > 1: all n of them).
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)  # its longest sequence


class StatLogger(Protocol):
    def log_engine_initialized(self, config: EngineConfig, num_gpu_blocks: int) -> None:
        """The engine is up with ``num_gpu_blocks`` KV blocks; called once, before any ``record``."""
        ...

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats, engine_idx: int = 0) -> None:
        """One step's stats of engine core ``engine_idx`` (data parallelism: 0 .. size - 1)."""
        ...


@dataclass
class _UserRequest:
    """One user request: n > 1 fans out into n engine-core requests that finish one by one."""

    n: int
    num_unfinished: int
    max_num_generated: int = 0

    def sequence_finished(self, num_generated: int, stats: IterationStats) -> None:
        """One of its sequences ended; after the last, report n and the longest sequence."""
        self.num_unfinished -= 1
        self.max_num_generated = max(self.max_num_generated, num_generated)
        if self.num_unfinished == 0:
            stats.n_params.append(self.n)
            stats.max_num_generation_tokens.append(self.max_num_generated)


@dataclass
class _Timing:
    """One engine-core request. ``arrival`` is the front end's clock; the rest the engine core's."""

    arrival: float
    num_prompt_tokens: int
    max_tokens: int | None
    user_request: _UserRequest
    queued: float | None = None
    scheduled: float | None = None  # the first admission; preemptions don't move it
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0
    num_cached: int = 0

    def take_events(self, events: list[EngineCoreEvent]) -> None:
        for event in events:
            if event.type == EngineCoreEventType.QUEUED:
                self.queued = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED and self.scheduled is None:
                self.scheduled = event.timestamp

    def intervals(self) -> ScheduledTiming | None:
        if self.queued is None or self.scheduled is None:
            return None
        queued = self.scheduled - self.queued
        if self.first_token is None or self.last_token is None:
            return ScheduledTiming(queued)
        decode = self.last_token - self.first_token
        tpot = decode / (self.num_generated - 1) if self.num_generated > 1 else None
        return CompletedTiming(
            queued, self.first_token - self.scheduled, decode, self.last_token - self.scheduled, tpot
        )


class IterationStatsTracker:
    """Keeps the few timestamps per request that the latency and size metrics need. TTFT and
    end-to-end latency are measured on the front end's clock from arrival; the other intervals
    on the engine core's, from its events and each step's ``EngineCoreOutputs.timestamp``."""

    def __init__(self) -> None:
        self._timings: dict[str, _Timing] = {}

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Track one user request: its engine-core requests (n > 1: its n children)."""
        user_request = _UserRequest(len(requests), len(requests))
        for r in requests:
            max_tokens = r.sampling_params.max_tokens
            self._timings[r.request_id] = _Timing(r.arrival_time, len(r.prompt_token_ids), max_tokens, user_request)

    def observe(self, outputs: EngineCoreOutputs, now: float | None = None) -> IterationStats:
        now = time.monotonic() if now is None else now
        stats = IterationStats()
        for out in outputs.outputs:
            timing = self._timings.get(out.request_id)
            if timing is not None:
                self._observe_one(timing, out, outputs.timestamp, now, stats)
                if out.finished:
                    self.finish(out.request_id, str(out.finish_reason), now, stats)
        return stats

    def _observe_one(
        self, timing: _Timing, out: EngineCoreOutput, step_time: float, now: float, stats: IterationStats
    ) -> None:
        if out.events:
            timing.take_events(out.events)
        n = len(out.new_token_ids)
        if n == 0:
            if out.pooling_output is not None:  # a pooling request's prompt counts once it is embedded
                stats.num_prompt_tokens += timing.num_prompt_tokens
                stats.num_cached_prompt_tokens += out.num_cached_tokens
            return
        if timing.first_token is None:
            stats.time_to_first_tokens.append(now - timing.arrival)
            stats.num_prompt_tokens += timing.num_prompt_tokens
            stats.num_cached_prompt_tokens += out.num_cached_tokens
            timing.first_token, timing.num_cached = step_time, out.num_cached_tokens
        else:
            assert timing.last_token is not None  # set with first_token
            stats.inter_token_latencies.extend([(step_time - timing.last_token) / n] * n)
        stats.num_generation_tokens += n
        timing.last_token = step_time
        timing.num_generated += n

    def finish(self, request_id: str, reason: str, now: float, stats: IterationStats) -> None:
        """Record a finished (or aborted, or stop-string-ended) request and forget it."""
        timing = self._timings.pop(request_id, None)
        if timing is None:
            return
        stats.finished_requests.append(
            FinishedRequestStats(
                reason,
                now - timing.arrival,
                timing.num_prompt_tokens,
                timing.num_generated,
                timing.max_tokens,
                timing.num_cached,
                timing.intervals(),
            )
        )
        timing.user_request.sequence_finished(timing.num_generated, stats)


class LoggingStatLogger:
    """Logs throughput and cache usage every ``interval`` seconds while there is work (with data
    parallelism: summed over the engine cores, each core's latest snapshot)."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last = time.monotonic()
        self._prompt = self._gen = 0
        self._latest: dict[int, SchedulerStats] = {}
        self._drafts = SpecDecodingStats()  # accumulated between log lines

    def log_engine_initialized(self, config: EngineConfig, num_gpu_blocks: int) -> None:
        logger.debug("KV cache: %d blocks of %d tokens", num_gpu_blocks, config.cache_config.block_size)

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats, engine_idx: int = 0) -> None:
        self._prompt += iteration.num_prompt_tokens
        self._gen += iteration.num_generation_tokens
        if scheduler_stats is not None:
            self._latest[engine_idx] = scheduler_stats
        spec = scheduler_stats.spec_decoding if scheduler_stats is not None else None
        if spec is not None:
            self._drafts.num_drafts += spec.num_drafts
            self._drafts.num_draft_tokens += spec.num_draft_tokens
            self._drafts.num_accepted_tokens += spec.num_accepted_tokens
        now = time.monotonic()
        if now - self._last >= self.interval and (self._gen or self._prompt):
            self._log(now - self._last)
            self._last, self._prompt, self._gen = now, 0, 0

    def _log(self, elapsed: float) -> None:
        latest = list(self._latest.values()) or [SchedulerStats()]
        logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%%",
            self._prompt / elapsed,
            self._gen / elapsed,
            sum(s.num_running_reqs for s in latest),
            sum(s.num_waiting_reqs for s in latest),
            100 * sum(s.kv_cache_usage for s in latest) / len(latest),  # each core's pool is the same size
        )
        d = self._drafts
        if d.num_drafts:
            logger.info(
                "speculative decoding: acceptance rate %.1f%%, mean accepted length %.2f, %d drafts",
                100 * d.num_accepted_tokens / d.num_draft_tokens,
                1 + d.num_accepted_tokens / d.num_drafts,
                d.num_drafts,
            )
            self._drafts = SpecDecodingStats()
