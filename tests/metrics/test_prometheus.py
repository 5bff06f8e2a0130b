"""PrometheusStatLogger: exact values in the exposition for hand-made stats."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.config import EngineArgs
from pagedllm.engine.protocol import SchedulerStats, SpecDecodingStats
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.stats import CompletedTiming, FinishedRequestStats, IterationStats, ScheduledTiming


def samples(logger: PrometheusStatLogger) -> dict[tuple, float]:
    """{(sample name, sorted labels without model_name and engine): value}; checks both labels on
    every sample (cache_config_info carries engine only, as in vLLM)."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(logger.registry).decode()):
        for s in family.samples:
            assert s.labels.pop("engine") == "0"
            if family.name != "vllm:cache_config_info":
                assert s.labels.pop("model_name") == logger.model_name
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(data: dict, name: str, **labels: str) -> float:
    return data[(name, tuple(sorted(labels.items())))]


def finished(reason: str, e2e: float, timing: ScheduledTiming | None = None, **kw) -> FinishedRequestStats:
    return FinishedRequestStats(reason, e2e, num_prompt_tokens=3, num_generation_tokens=2, timing=timing, **kw)


def test_fresh_logger_exposes_every_series_at_zero():
    data = samples(PrometheusStatLogger("m"))
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:prompt_tokens_cached_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:mm_cache_queries_total",
        "vllm:mm_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:spec_decode_num_drafts_total",
    ):
        assert value(data, name) == 0
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert value(data, "vllm:request_success_total", finished_reason=reason) == 0
    for reason in ("capacity", "deferred"):
        assert value(data, "vllm:num_requests_waiting_by_reason", reason=reason) == 0
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        assert value(data, "vllm:prompt_tokens_by_source_total", source=source) == 0
    # No sleep mode here: always awake.
    assert value(data, "vllm:engine_sleep_state", sleep_state="awake") == 1
    assert value(data, "vllm:engine_sleep_state", sleep_state="weights_offloaded") == 0
    assert value(data, "vllm:engine_sleep_state", sleep_state="discard_all") == 0
    for name in ("time_to_first_token_seconds", "request_queue_time_seconds", "iteration_tokens_total"):
        assert value(data, f"vllm:{name}_count") == 0


def test_record_sums_counters_and_keeps_latest_gauges():
    logger = PrometheusStatLogger("tiny")
    logger.record(
        SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=5,
            num_deferred_reqs=2,
            kv_cache_usage=0.25,
            prefix_cache_queries=64,
            prefix_cache_hits=32,
            num_preemptions=1,
            num_scheduled_tokens=40,
        ),
        IterationStats(
            num_prompt_tokens=10, num_cached_prompt_tokens=4, num_generation_tokens=3, time_to_first_tokens=[0.05, 0.3]
        ),
    )
    logger.record(
        SchedulerStats(
            num_running_reqs=1,
            num_waiting_reqs=0,
            kv_cache_usage=0.5,
            prefix_cache_queries=16,
            prefix_cache_hits=16,
            num_scheduled_tokens=2,
        ),
        IterationStats(
            num_generation_tokens=2,
            inter_token_latencies=[0.02, 0.02],
            finished_requests=[finished("stop", 0.4), finished("length", 2.0)],
            n_params=[2],
            max_num_generation_tokens=[2],
        ),
    )
    logger.record(SchedulerStats(), IterationStats(finished_requests=[finished("abort", 0.1), finished("error", 1.2)]))
    data = samples(logger)
    assert value(data, "vllm:num_requests_running") == 0
    assert value(data, "vllm:num_requests_waiting") == 0
    assert value(data, "vllm:kv_cache_usage_perc") == 0
    assert value(data, "vllm:prompt_tokens_total") == 10
    assert value(data, "vllm:prompt_tokens_by_source_total", source="local_compute") == 6
    assert value(data, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 4
    assert value(data, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert value(data, "vllm:prompt_tokens_cached_total") == 4
    assert value(data, "vllm:generation_tokens_total") == 5
    assert value(data, "vllm:prefix_cache_queries_total") == 80
    assert value(data, "vllm:prefix_cache_hits_total") == 48
    assert value(data, "vllm:num_preemptions_total") == 1
    # An idle step (no model step: 0 tokens) is not an iteration.
    assert value(data, "vllm:iteration_tokens_total_count") == 2
    assert value(data, "vllm:iteration_tokens_total_sum") == 42
    assert value(data, "vllm:iteration_tokens_total_bucket", le="1.0") == 0
    assert value(data, "vllm:iteration_tokens_total_bucket", le="8.0") == 1
    for reason, count in (("stop", 1), ("length", 1), ("abort", 1), ("error", 1), ("repetition", 0)):
        assert value(data, "vllm:request_success_total", finished_reason=reason) == count
    assert value(data, "vllm:time_to_first_token_seconds_count") == 2
    assert value(data, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.35)
    assert value(data, "vllm:time_to_first_token_seconds_bucket", le="0.06") == 1
    assert value(data, "vllm:inter_token_latency_seconds_count") == 2
    assert value(data, "vllm:inter_token_latency_seconds_bucket", le="0.025") == 2
    assert value(data, "vllm:e2e_request_latency_seconds_count") == 4
    assert value(data, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(3.7)
    assert value(data, "vllm:e2e_request_latency_seconds_bucket", le="0.5") == 2
    assert value(data, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == 4
    assert value(data, "vllm:request_prompt_tokens_count") == 4
    assert value(data, "vllm:request_prompt_tokens_sum") == 12
    assert value(data, "vllm:request_generation_tokens_sum") == 8
    assert value(data, "vllm:request_params_n_sum") == 2
    assert value(data, "vllm:request_max_num_generation_tokens_count") == 1


def test_waiting_by_reason_splits_the_waiting_queue():
    logger = PrometheusStatLogger("m")
    logger.record(SchedulerStats(num_waiting_reqs=7, num_deferred_reqs=3), IterationStats())
    data = samples(logger)
    assert value(data, "vllm:num_requests_waiting") == 7
    assert value(data, "vllm:num_requests_waiting_by_reason", reason="capacity") == 4
    assert value(data, "vllm:num_requests_waiting_by_reason", reason="deferred") == 3


def test_request_phases_are_observed_by_how_far_the_request_got():
    logger = PrometheusStatLogger("m")
    done = CompletedTiming(
        queued_time=0.1, prefill_time=0.2, decode_time=0.6, inference_time=0.8, mean_time_per_output_token=0.3
    )
    one_token = CompletedTiming(0.4, 0.5, 0.0, 0.5, None)
    requests = [
        finished("length", 1.0, done, max_tokens_param=2, num_cached_tokens=1),
        finished("stop", 1.0, one_token),
        finished("abort", 1.0, ScheduledTiming(queued_time=0.7)),  # aborted during its prefill
        finished("abort", 1.0),  # aborted while queued
    ]
    logger.record(None, IterationStats(finished_requests=requests))
    data = samples(logger)
    assert value(data, "vllm:request_queue_time_seconds_count") == 3
    assert value(data, "vllm:request_queue_time_seconds_sum") == pytest.approx(1.2)
    for name, total in (("prefill", 0.7), ("decode", 0.6), ("inference", 1.3)):
        assert value(data, f"vllm:request_{name}_time_seconds_count") == 2
        assert value(data, f"vllm:request_{name}_time_seconds_sum") == pytest.approx(total)
    assert value(data, "vllm:request_time_per_output_token_seconds_count") == 1
    assert value(data, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.3)
    assert value(data, "vllm:request_prefill_kv_computed_tokens_count") == 2
    assert value(data, "vllm:request_prefill_kv_computed_tokens_sum") == 2 + 3
    assert value(data, "vllm:request_params_max_tokens_count") == 1  # None: no max_tokens given
    assert value(data, "vllm:request_prompt_tokens_count") == 4


def test_loggers_have_separate_registries():
    a, b = PrometheusStatLogger("a"), PrometheusStatLogger("b")  # would clash on one global registry
    a.record(None, IterationStats(num_generation_tokens=7))
    assert value(samples(a), "vllm:generation_tokens_total") == 7
    assert value(samples(b), "vllm:generation_tokens_total") == 0


def test_spec_decode_counters():
    logger = PrometheusStatLogger("m")
    spec = SpecDecodingStats()
    spec.observe(3, 2)
    spec.observe(4, 0)
    logger.record(SchedulerStats(spec_decoding=spec), IterationStats())
    logger.record(SchedulerStats(spec_decoding=spec), IterationStats())
    data = samples(logger)
    assert value(data, "vllm:spec_decode_num_drafts_total") == 4
    assert value(data, "vllm:spec_decode_num_draft_tokens_total") == 14
    assert value(data, "vllm:spec_decode_num_accepted_tokens_total") == 4
    assert value(data, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 2
    assert value(data, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2
    assert value(data, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="3") == 0


def test_engine_config_sets_token_buckets_spec_counters_and_cache_info(llama_model_dir):
    config = EngineArgs(
        model=str(llama_model_dir), max_model_len=128, block_size=32, num_gpu_blocks_override=9
    ).create_engine_config()
    logger = PrometheusStatLogger("m", config=config)
    logger.log_engine_initialized(config, 9)
    data = samples(logger)
    edges = sorted(float(dict(k[1])["le"]) for k in data if k[0] == "vllm:request_prompt_tokens_bucket")
    assert edges == [1, 2, 5, 10, 20, 50, 100, float("inf")]  # 1-2-5 up to max_model_len
    assert not any(k[0].startswith("vllm:spec_decode") for k in data)  # no speculative config: none
    info = [dict(k[1]) for k in data if k[0] == "vllm:cache_config_info"]
    assert len(info) == 1 and value(data, "vllm:cache_config_info", **info[0]) == 1
    assert info[0]["block_size"] == "32" and info[0]["num_gpu_blocks"] == "9"
    assert info[0]["num_gpu_blocks_override"] == "9" and info[0]["enable_prefix_caching"] == "True"
    assert set(info[0]) == {
        "block_size",
        "kv_cache_memory_bytes",
        "gpu_memory_utilization",
        "enable_prefix_caching",
        "num_gpu_blocks_override",
        "swap_space_bytes",
        "kv_cache_dtype",
        "num_gpu_blocks",
    }
    assert info[0]["kv_cache_dtype"] == "float32"
