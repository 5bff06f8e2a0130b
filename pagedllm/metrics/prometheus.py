"""Prometheus metrics under vLLM's names (prefix ``vllm:``), so existing dashboards work unchanged.

The series are vLLM's V1 set, name for name, type for type, label for label and with vLLM's
bucket edges; docs/metrics.md lists them and says which stay at zero here and why. Every series
carries ``model_name`` and ``engine``: the engine core's index, "0" unless data parallelism runs
several (then each core's stats go to its own series, as vLLM's; a dashboard sums them). Each logger
owns its own ``CollectorRegistry`` (never the process-global one), so several servers or tests
can live in one process. prometheus_client appends ``_total`` to counter names itself:
``Counter("vllm:prompt_tokens")`` is exposed as ``vllm:prompt_tokens_total``.

Beside them, two older vLLM names that users' dashboards and recipes still query (vLLM
deprecated them in 0.10/0.11 and then removed them): ``vllm:gpu_cache_usage_perc`` (the same
value as ``vllm:kv_cache_usage_perc``) and ``vllm:time_per_output_token_seconds`` (the same
observations and buckets as ``vllm:inter_token_latency_seconds``, as in vLLM's V1 engine).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.engine.protocol import SchedulerStats, SpecDecodingStats
from pagedllm.metrics.buckets import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    N_PARAM_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    build_1_2_5_buckets,
)
from pagedllm.metrics.stats import CompletedTiming, FinishedRequestStats, IterationStats

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

METRIC_PREFIX = "vllm:"
OWN_METRIC_PREFIX = "pagedllm:"  # series vLLM has no counterpart of
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
WAITING_REASONS = ("capacity", "deferred")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
# The token-count histograms' top edge when no engine config is given (else max_model_len).
FALLBACK_MAX_MODEL_LEN = 1_000_000


class PrometheusStatLogger:
    """A ``StatLogger`` that keeps vLLM-named gauges, counters and histograms up to date.

    ``config`` sets the token-count buckets (up to max_model_len) and whether the speculative
    decoding counters exist; without it they do, and the buckets go up to 10^6 tokens.
    ``num_engines`` (data parallelism): one set of series per engine core, ``engine="0"`` ..
    ``engine="N-1"``; this logger is engine 0's and hands the others' stats to siblings that
    share its registry and metric families (``engines``)."""

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        config: EngineConfig | None = None,
        num_engines: int = 1,
        _engine: tuple[int, dict[str, Any]] = (0, {}),
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self.engine_label = str(_engine[0])
        self._families = _engine[1] if _engine[0] else {}  # name -> family, shared by the siblings
        self._make_scheduler_gauges()
        self._make_cache_counters()
        self._make_token_counters()
        self._make_size_histograms(FALLBACK_MAX_MODEL_LEN if config is None else config.model_config.max_model_len)
        self._make_latency_histograms()
        if config is None:
            self._make_spec_counters(0)
        elif config.speculative_config is not None:
            self._make_spec_counters(config.speculative_config.num_speculative_tokens)
        self.swap_out: Any = None  # these two only with a swap tier (--swap-space)
        self.swap_in: Any = None
        if config is not None and config.cache_config.swap_space_bytes:
            self._make_swap_counters()
        self.lora_info: Any = None  # vllm:lora_requests_info, only with LoRA (as vLLM)
        if config is not None and config.lora_config is not None:
            self._make_lora_info(config.lora_config.max_loras)
        self.engines: list[PrometheusStatLogger] = [self] + [
            PrometheusStatLogger(model_name, self.registry, config, 1, (i, self._families))
            for i in range(1, num_engines)
        ]

    # ------------------------------------------------------------------ creation
    def _shared(self, name: str, labels: list[str], make: Any) -> Any:
        """The family ``name``: made (``make(name, labels)``) by the first engine's logger, reused by the rest."""
        if name not in self._families:
            self._families[name] = make(name, labels)
        return self._families[name]

    def _family(self, cls: type, name: str, doc: str, extra_labels: tuple[str, ...] = (), **kw: Any) -> Any:
        labels = ["model_name", "engine", *extra_labels]
        return self._shared(METRIC_PREFIX + name, labels, lambda n, ls: cls(n, doc, ls, registry=self.registry, **kw))

    def _one(self, cls: type, name: str, doc: str, **kw: Any) -> Any:
        return self._family(cls, name, doc, **kw).labels(self.model_name, self.engine_label)

    def _per_label(self, cls: type, name: str, doc: str, label: str, values: tuple[str, ...]) -> dict[str, Any]:
        """One child per label value, all created now so each series shows (at 0) from the start."""
        family = self._family(cls, name, doc, (label,))
        return {v: family.labels(self.model_name, self.engine_label, v) for v in values}

    def _make_scheduler_gauges(self) -> None:
        self.running = self._one(Gauge, "num_requests_running", "Requests in the model batch this step.")
        self.waiting = self._one(Gauge, "num_requests_waiting", "Requests waiting to be scheduled.")
        self.waiting_by_reason = self._per_label(
            Gauge,
            "num_requests_waiting_by_reason",
            "Waiting requests by reason: 'capacity' = no room in the batch or KV cache yet; 'deferred' = "
            "its grammar is still compiling. The reasons sum to vllm:num_requests_waiting.",
            "reason",
            WAITING_REASONS,
        )
        self.kv_usage = self._one(Gauge, "kv_cache_usage_perc", "KV-cache usage as a fraction: 0 = empty, 1 = full.")
        self.gpu_cache_usage = self._one(
            Gauge,
            "gpu_cache_usage_perc",
            "KV-cache usage (1 = 100 percent). Older vLLM name: the same value as vllm:kv_cache_usage_perc.",
        )
        sleep = self._per_label(
            Gauge,
            "engine_sleep_state",
            "Engine sleep state (this engine has no sleep mode: awake).",
            "sleep_state",
            SLEEP_STATES,
        )
        sleep["awake"].set(1)

    def _make_cache_counters(self) -> None:
        self.prefix_queries = self._one(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = self._one(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # No KV connector and no multimodal inputs here: these exist, as in vLLM, and stay at 0.
        self._one(Counter, "external_prefix_cache_queries", "Tokens looked up in an external KV cache (none here).")
        self._one(Counter, "external_prefix_cache_hits", "Tokens found in an external KV cache (none here).")
        self._one(Counter, "mm_cache_queries", "Multimodal cache queries (no multimodal inputs here).")
        self._one(Counter, "mm_cache_hits", "Multimodal cache hits (no multimodal inputs here).")

    def _make_token_counters(self) -> None:
        self.preemptions = self._one(
            Counter, "num_preemptions", "Requests preempted (KV blocks freed, recomputed later)."
        )
        self.prompt_tokens = self._one(Counter, "prompt_tokens", "Prompt tokens of the prefills that completed.")
        self.prompt_tokens_by_source = self._per_label(
            Counter, "prompt_tokens_by_source", "Prompt tokens by source.", "source", PROMPT_TOKEN_SOURCES
        )
        self.prompt_tokens_cached = self._one(Counter, "prompt_tokens_cached", "Prompt tokens from the prefix cache.")
        self.generation_tokens = self._one(Counter, "generation_tokens", "Tokens generated.")
        self.request_success = self._per_label(
            Counter, "request_success", "Finished requests, by finish reason.", "finished_reason", FINISH_REASONS
        )

    def _make_size_histograms(self, max_model_len: int) -> None:
        tokens = build_1_2_5_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = tokens) -> Any:
            return self._one(Histogram, name, doc, buckets=buckets)

        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.")
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request."
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens the model computed per engine step.", ITERATION_TOKENS_BUCKETS
        )
        self.max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Tokens of a request's longest sequence (n > 1: of its n)."
        )
        self.params_n = histogram("request_params_n", "The n request parameter.", N_PARAM_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens request parameter.")
        self.prefill_kv_computed = histogram(
            "request_prefill_kv_computed_tokens", "Prompt tokens a prefill computed (not found in the prefix cache)."
        )

    def _make_latency_histograms(self) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...] = REQUEST_LATENCY_BUCKETS) -> Any:
            return self._one(Histogram, name, doc, buckets=buckets)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to the first output token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds. Older vLLM name: the same observations as "
            "vllm:inter_token_latency_seconds.",
            ITL_BUCKETS,
        )
        self.request_tpot = histogram(
            "request_time_per_output_token_seconds", "A request's decode time per token after the first.", ITL_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last output token.")
        self.queue_time = histogram("request_queue_time_seconds", "Queued in the engine core to first scheduled.")
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to the last token.")
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to the first token.")
        self.decode_time = histogram("request_decode_time_seconds", "First token to the last token.")

    def _make_swap_counters(self) -> None:
        labels = ["model_name", "engine"]
        self.swap_out, self.swap_in = (
            self._shared(
                OWN_METRIC_PREFIX + name, labels, lambda n, ls, doc=doc: Counter(n, doc, ls, registry=self.registry)
            ).labels(self.model_name, self.engine_label)
            for name, doc in (
                ("kv_swap_out_blocks", "Evicted prefix-cache blocks copied to the swap tier."),
                ("kv_swap_in_blocks", "Prefix-cache blocks copied back from the swap tier (instead of recomputed)."),
            )
        )

    def _make_spec_counters(self, num_positions: int) -> None:
        """``num_positions``: the per-position series shown from the start (0: as they come)."""
        self.spec_drafts = self._one(
            Counter, "spec_decode_num_drafts", "Speculative decoding: verification steps per request."
        )
        self.spec_draft_tokens = self._one(
            Counter, "spec_decode_num_draft_tokens", "Speculative decoding: proposed tokens."
        )
        self.spec_accepted_tokens = self._one(
            Counter, "spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted."
        )
        self._spec_per_pos = self._family(
            Counter,
            "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: accepted tokens by position in the proposal.",
            ("position",),
        )
        for pos in range(num_positions):
            self._spec_per_pos.labels(self.model_name, self.engine_label, str(pos))

    # ------------------------------------------------------------------ StatLogger
    def _make_lora_info(self, max_loras: int) -> None:
        """vLLM's LoRA gauge: its labels carry the adapters (comma-separated names), its value
        the time of the last update; no model_name/engine labels, as in vLLM."""
        self.max_lora = str(max_loras)
        self.lora_info = self._shared(
            METRIC_PREFIX + "lora_requests_info",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            lambda n, ls: Gauge(n, "Running stats on lora requests.", ls, registry=self.registry),
        )

    def _record_lora(self, s: SchedulerStats) -> None:
        running, waiting = ",".join(s.running_lora_adapters), ",".join(s.waiting_lora_adapters)
        self.lora_info.labels(self.max_lora, waiting, running).set_to_current_time()

    def log_engine_initialized(self, config: EngineConfig, num_gpu_blocks: int) -> None:
        """``vllm:cache_config_info``: a gauge at 1 whose labels are the cache config's fields (one
        per engine core: they all have the same pool)."""
        for engine in self.engines:
            info = {name: str(value) for name, value in dataclasses.asdict(config.cache_config).items()}
            info |= {"num_gpu_blocks": str(num_gpu_blocks), "engine": engine.engine_label}
            gauge = self._shared(
                METRIC_PREFIX + "cache_config_info",
                list(info),
                lambda n, ls: Gauge(
                    n, "The KV cache configuration, in the labels (always 1).", ls, registry=self.registry
                ),
            )
            gauge.labels(**info).set(1)

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats, engine_idx: int = 0) -> None:
        """Into engine core ``engine_idx``'s series."""
        self.engines[engine_idx].record_own(scheduler_stats, iteration)

    def record_own(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None:
        if scheduler_stats is not None:
            self._record_scheduler(scheduler_stats)
        self._record_tokens(iteration)
        self._record_latencies(iteration)
        for finished in iteration.finished_requests:
            self._record_finished(finished)

    def _record_scheduler(self, s: SchedulerStats) -> None:
        self.running.set(s.num_running_reqs)
        self.waiting.set(s.num_waiting_reqs)
        self.waiting_by_reason["capacity"].set(s.num_waiting_reqs - s.num_deferred_reqs)
        self.waiting_by_reason["deferred"].set(s.num_deferred_reqs)
        self.kv_usage.set(s.kv_cache_usage)
        self.gpu_cache_usage.set(s.kv_cache_usage)
        self.prefix_queries.inc(s.prefix_cache_queries)
        self.prefix_hits.inc(s.prefix_cache_hits)
        self.preemptions.inc(s.num_preemptions)
        if self.swap_out is not None:
            self.swap_out.inc(s.kv_swap_out_blocks)
            self.swap_in.inc(s.kv_swap_in_blocks)
        if s.num_scheduled_tokens:
            self.iteration_tokens.observe(s.num_scheduled_tokens)
        if s.spec_decoding is not None:
            self._record_spec(s.spec_decoding)
        if self.lora_info is not None:
            self._record_lora(s)

    def _record_spec(self, spec: SpecDecodingStats) -> None:
        self.spec_drafts.inc(spec.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
        for pos, count in enumerate(spec.num_accepted_tokens_per_pos):
            self._spec_per_pos.labels(self.model_name, self.engine_label, str(pos)).inc(count)

    def _record_tokens(self, it: IterationStats) -> None:
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.prompt_tokens_by_source["local_compute"].inc(it.num_prompt_tokens - it.num_cached_prompt_tokens)
        self.prompt_tokens_by_source["local_cache_hit"].inc(it.num_cached_prompt_tokens)
        self.prompt_tokens_cached.inc(it.num_cached_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        for n in it.n_params:
            self.params_n.observe(n)
        for num_tokens in it.max_num_generation_tokens:
            self.max_num_generation_tokens.observe(num_tokens)

    def _record_latencies(self, it: IterationStats) -> None:
        for value in it.time_to_first_tokens:
            self.ttft.observe(value)
        for value in it.inter_token_latencies:
            self.itl.observe(value)
            self.tpot.observe(value)

    def _record_finished(self, f: FinishedRequestStats) -> None:
        self.request_success[f.finish_reason].inc()
        self.e2e.observe(f.e2e_latency)
        self.request_prompt_tokens.observe(f.num_prompt_tokens)
        self.request_generation_tokens.observe(f.num_generation_tokens)
        if f.max_tokens_param:
            self.params_max_tokens.observe(f.max_tokens_param)
        if f.timing is not None:
            self.queue_time.observe(f.timing.queued_time)
        if isinstance(f.timing, CompletedTiming):
            self._record_phases(f.timing)
            self.prefill_kv_computed.observe(f.num_prompt_tokens - f.num_cached_tokens)

    def _record_phases(self, t: CompletedTiming) -> None:
        self.prefill_time.observe(t.prefill_time)
        self.decode_time.observe(t.decode_time)
        self.inference_time.observe(t.inference_time)
        if t.mean_time_per_output_token is not None:
            self.request_tpot.observe(t.mean_time_per_output_token)
