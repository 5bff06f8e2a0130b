"""PrometheusStatLogger: exact values in the exposition for hand-made stats."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.engine.protocol import SchedulerStats
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.stats import FinishedRequestStats, IterationStats


def samples(logger: PrometheusStatLogger) -> dict[tuple, float]:
    """{(sample name, sorted labels without model_name): value}; checks model_name on every sample."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(logger.registry).decode()):
        for s in family.samples:
            assert s.labels.pop("model_name") == logger.model_name
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(data: dict, name: str, **labels: str) -> float:
    return data[(name, tuple(sorted(labels.items())))]


def finished(reason: str, e2e: float) -> FinishedRequestStats:
    return FinishedRequestStats(reason, e2e, num_prompt_tokens=3, num_generation_tokens=2)


def test_fresh_logger_exposes_every_series_at_zero():
    data = samples(PrometheusStatLogger("m"))
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
    ):
        assert value(data, name) == 0
    for reason in ("stop", "length", "abort"):
        assert value(data, "vllm:request_success_total", finished_reason=reason) == 0
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert value(data, f"vllm:{name}_seconds_count") == 0


def test_record_sums_counters_and_keeps_latest_gauges():
    logger = PrometheusStatLogger("tiny")
    logger.record(
        SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=5,
            kv_cache_usage=0.25,
            prefix_cache_queries=64,
            prefix_cache_hits=32,
            num_preemptions=1,
        ),
        IterationStats(num_prompt_tokens=10, num_generation_tokens=3, time_to_first_tokens=[0.05, 0.3]),
    )
    logger.record(
        SchedulerStats(
            num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.5, prefix_cache_queries=16, prefix_cache_hits=16
        ),
        IterationStats(
            num_generation_tokens=2,
            inter_token_latencies=[0.02, 0.02],
            finished_requests=[finished("stop", 0.4), finished("length", 2.0)],
        ),
    )
    logger.record(None, IterationStats(finished_requests=[finished("abort", 0.1), finished("stop", 1.2)]))
    data = samples(logger)
    assert value(data, "vllm:num_requests_running") == 1
    assert value(data, "vllm:num_requests_waiting") == 0
    assert value(data, "vllm:kv_cache_usage_perc") == 0.5
    assert value(data, "vllm:prompt_tokens_total") == 10
    assert value(data, "vllm:generation_tokens_total") == 5
    assert value(data, "vllm:prefix_cache_queries_total") == 80
    assert value(data, "vllm:prefix_cache_hits_total") == 48
    assert value(data, "vllm:num_preemptions_total") == 1
    assert value(data, "vllm:request_success_total", finished_reason="stop") == 2
    assert value(data, "vllm:request_success_total", finished_reason="length") == 1
    assert value(data, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(data, "vllm:time_to_first_token_seconds_count") == 2
    assert value(data, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.35)
    assert value(data, "vllm:time_to_first_token_seconds_bucket", le="0.06") == 1
    assert value(data, "vllm:inter_token_latency_seconds_count") == 2
    assert value(data, "vllm:inter_token_latency_seconds_bucket", le="0.025") == 2
    assert value(data, "vllm:e2e_request_latency_seconds_count") == 4
    assert value(data, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(3.7)
    assert value(data, "vllm:e2e_request_latency_seconds_bucket", le="0.5") == 2
    assert value(data, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == 4


def test_loggers_have_separate_registries():
    a, b = PrometheusStatLogger("a"), PrometheusStatLogger("b")  # would clash on one global registry
    a.record(None, IterationStats(num_generation_tokens=7))
    assert value(samples(a), "vllm:generation_tokens_total") == 7
    assert value(samples(b), "vllm:generation_tokens_total") == 0


def test_spec_decode_counters():
    from pagedllm.engine.protocol import SpecDecodingStats

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
