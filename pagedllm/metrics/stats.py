"""Per-iteration statistics the front end derives from engine outputs, and the logger interface."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.engine.protocol import EngineCoreOutput, SchedulerStats, SpecDecodingStats

logger = logging.getLogger(__name__)


@dataclass
class FinishedRequestStats:
    finish_reason: str  # stop | length | abort
    e2e_latency: float  # seconds from arrival to the last output
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one engine step produced, as seen by the front end."""

    num_prompt_tokens: int = 0  # prompts whose first output token arrived this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None: ...


@dataclass
class _Timing:
    arrival: float
    num_prompt_tokens: int
    last_token: float | None = None
    num_generated: int = 0


class IterationStatsTracker:
    """Keeps the few timestamps per request that TTFT, ITL and latency need."""

    def __init__(self) -> None:
        self._timings: dict[str, _Timing] = {}

    def add_request(self, request_id: str, arrival: float, num_prompt_tokens: int) -> None:
        self._timings[request_id] = _Timing(arrival, num_prompt_tokens)

    def observe(self, outputs: list[EngineCoreOutput], now: float | None = None) -> IterationStats:
        now = time.monotonic() if now is None else now
        stats = IterationStats()
        for out in outputs:
            timing = self._timings.get(out.request_id)
            if timing is not None:
                self._observe_one(timing, out, now, stats)
                if out.finished:
                    self.finish(out.request_id, str(out.finish_reason), now, stats)
        return stats

    def _observe_one(self, timing: _Timing, out: EngineCoreOutput, now: float, stats: IterationStats) -> None:
        n = len(out.new_token_ids)
        if n == 0:
            return
        if timing.last_token is None:
            stats.time_to_first_tokens.append(now - timing.arrival)
            stats.num_prompt_tokens += timing.num_prompt_tokens
        else:
            stats.inter_token_latencies.extend([(now - timing.last_token) / n] * n)
        stats.num_generation_tokens += n
        timing.last_token = now
        timing.num_generated += n

    def finish(self, request_id: str, reason: str, now: float, stats: IterationStats) -> None:
        """Record a finished (or aborted, or stop-string-ended) request and forget it."""
        timing = self._timings.pop(request_id, None)
        if timing is not None:
            stats.finished_requests.append(
                FinishedRequestStats(reason, now - timing.arrival, timing.num_prompt_tokens, timing.num_generated)
            )


class LoggingStatLogger:
    """Logs throughput and cache usage every ``interval`` seconds while there is work."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last = time.monotonic()
        self._prompt = self._gen = 0
        self._latest: SchedulerStats | None = None
        self._drafts = SpecDecodingStats()  # accumulated between log lines

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None:
        self._prompt += iteration.num_prompt_tokens
        self._gen += iteration.num_generation_tokens
        self._latest = scheduler_stats or self._latest
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
        s = self._latest or SchedulerStats()
        logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%%",
            self._prompt / elapsed,
            self._gen / elapsed,
            s.num_running_reqs,
            s.num_waiting_reqs,
            100 * s.kv_cache_usage,
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
