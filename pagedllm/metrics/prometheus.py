"""Prometheus metrics under vLLM's names (prefix ``vllm:``), so existing dashboards work unchanged.

Every metric carries a ``model_name`` label. Each logger owns its own ``CollectorRegistry``
(never the process-global one), so several servers or tests can live in one process.
prometheus_client appends ``_total`` to counter names itself: ``Counter("vllm:prompt_tokens")``
is exposed as ``vllm:prompt_tokens_total``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.engine.protocol import SchedulerStats, SpecDecodingStats
from pagedllm.metrics.stats import IterationStats

METRIC_PREFIX = "vllm:"
FINISH_REASONS = ("stop", "length", "abort")

# Bucket edges as vLLM's (seconds).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class PrometheusStatLogger:
    """A ``StatLogger`` that keeps vLLM-named gauges, counters and histograms up to date."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._make_gauges()
        self._make_counters()
        self._make_histograms()

    def _name(self, name: str) -> str:
        return METRIC_PREFIX + name

    def _make_gauges(self) -> None:
        def gauge(name: str, doc: str):
            return Gauge(self._name(name), doc, ["model_name"], registry=self.registry).labels(self.model_name)

        self.running = gauge("num_requests_running", "Requests in the model batch this step.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage as a fraction: 0 = empty, 1 = full.")

    def _make_counters(self) -> None:
        def counter(name: str, doc: str):
            return Counter(self._name(name), doc, ["model_name"], registry=self.registry).labels(self.model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (KV blocks freed, recomputed later).")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative decoding: verification steps per request.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative decoding: proposed tokens.")
        self.spec_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted."
        )
        self._spec_per_pos = Counter(
            self._name("spec_decode_num_accepted_tokens_per_pos"),
            "Speculative decoding: accepted tokens by position in the proposal.",
            ["model_name", "position"],
            registry=self.registry,
        )
        success = Counter(
            self._name("request_success"),
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # Pre-create every reason so each series is exposed (at 0) before the first request.
        self.request_success = {r: success.labels(self.model_name, r) for r in FINISH_REASONS}
        self._success_family = success

    def _make_histograms(self) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(self._name(name), doc, ["model_name"], buckets=buckets, registry=self.registry).labels(
                self.model_name
            )

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last output token.", E2E_BUCKETS)

    # ------------------------------------------------------------------ StatLogger
    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None:
        if scheduler_stats is not None:
            self._record_scheduler(scheduler_stats)
        self._record_iteration(iteration)

    def _record_scheduler(self, s: SchedulerStats) -> None:
        self.running.set(s.num_running_reqs)
        self.waiting.set(s.num_waiting_reqs)
        self.kv_usage.set(s.kv_cache_usage)
        self.prefix_queries.inc(s.prefix_cache_queries)
        self.prefix_hits.inc(s.prefix_cache_hits)
        self.preemptions.inc(s.num_preemptions)
        if s.spec_decoding is not None:
            self._record_spec(s.spec_decoding)

    def _record_spec(self, spec: SpecDecodingStats) -> None:
        self.spec_drafts.inc(spec.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
        for pos, count in enumerate(spec.num_accepted_tokens_per_pos):
            self._spec_per_pos.labels(self.model_name, str(pos)).inc(count)

    def _record_iteration(self, it: IterationStats) -> None:
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        for value in it.time_to_first_tokens:
            self.ttft.observe(value)
        for value in it.inter_token_latencies:
            self.itl.observe(value)
        for finished in it.finished_requests:
            reason = finished.finish_reason
            child = self.request_success.get(reason) or self._success_family.labels(self.model_name, reason)
            child.inc()
            self.e2e.observe(finished.e2e_latency)
