"""Our exposition against vLLM's V1 PrometheusStatLogger, written out here from vLLM's source
(vllm/v1/metrics/loggers.py, vllm/v1/spec_decode/metrics.py): every series by name, type,
labels, pre-created label values and bucket edges. A series missing, renamed, retyped or
relabelled here fails.

Left out, as vLLM leaves them out by default: vllm:lora_requests_info (only with LoRA),
vllm:corrupted_requests (only with VLLM_COMPUTE_NANS_IN_LOGITS), vllm:kv_block_*_seconds (only
with --kv-cache-metrics), the KV-connector, MFU and CUDA-graph series (only when configured), and
vllm:gpu_prefix_cache_* (deprecated, hidden, then removed, in vLLM).

Added beside them, as users' recipes still query them: the older vllm:gpu_cache_usage_perc and
vllm:time_per_output_token_seconds (VLLM_OLDER_SERIES; vLLM deprecated, hid, then removed them).
"""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.config import EngineArgs
from pagedllm.metrics.prometheus import PrometheusStatLogger

BASE = ("engine", "model_name")

# name (as the text format shows a family: counters without _total) -> (type, extra labels)
VLLM_SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:num_requests_waiting_by_reason": ("gauge", ("reason",)),
    "vllm:engine_sleep_state": ("gauge", ("sleep_state",)),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:external_prefix_cache_queries": ("counter", ()),
    "vllm:external_prefix_cache_hits": ("counter", ()),
    "vllm:mm_cache_queries": ("counter", ()),
    "vllm:mm_cache_hits": ("counter", ()),
    "vllm:num_preemptions": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:prompt_tokens_by_source": ("counter", ("source",)),
    "vllm:prompt_tokens_cached": ("counter", ()),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:request_prompt_tokens": ("histogram", ()),
    "vllm:request_generation_tokens": ("histogram", ()),
    "vllm:iteration_tokens_total": ("histogram", ()),
    "vllm:request_max_num_generation_tokens": ("histogram", ()),
    "vllm:request_params_n": ("histogram", ()),
    "vllm:request_params_max_tokens": ("histogram", ()),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:request_time_per_output_token_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    "vllm:request_queue_time_seconds": ("histogram", ()),
    "vllm:request_inference_time_seconds": ("histogram", ()),
    "vllm:request_prefill_time_seconds": ("histogram", ()),
    "vllm:request_decode_time_seconds": ("histogram", ()),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", ()),
}
# Older vLLM names (V0, and V1 up to 0.11 behind --show-hidden-metrics-for-version), exposed always.
VLLM_OLDER_SERIES = {
    "vllm:gpu_cache_usage_perc": ("gauge", ()),
    "vllm:time_per_output_token_seconds": ("histogram", ()),
}
# Only with a speculative config (SpecDecodingProm).
VLLM_SPEC_SERIES = {
    "vllm:spec_decode_num_drafts": ("counter", ()),
    "vllm:spec_decode_num_draft_tokens": ("counter", ()),
    "vllm:spec_decode_num_accepted_tokens": ("counter", ()),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", ("position",)),
}
# Label values vLLM creates up front, so the series show before the first event.
VLLM_LABEL_VALUES = {
    "reason": {"capacity", "deferred"},
    "sleep_state": {"awake", "weights_offloaded", "discard_all"},
    "source": {"local_compute", "local_cache_hit", "external_kv_transfer"},
    "finished_reason": {"stop", "length", "abort", "error", "repetition"},
}
_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0]
_TTFT += [80.0, 160.0, 640.0, 2560.0]
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0]
_LATENCY += [480.0, 960.0, 1920.0, 7680.0]
_TOKENS_256 = [1, 2, 5, 10, 20, 50, 100, 200]  # vLLM's build_1_2_5_buckets(max_model_len=256)
VLLM_BUCKETS = {
    "vllm:request_prompt_tokens": _TOKENS_256,
    "vllm:request_generation_tokens": _TOKENS_256,
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "vllm:request_max_num_generation_tokens": _TOKENS_256,
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:request_params_max_tokens": _TOKENS_256,
    "vllm:time_to_first_token_seconds": _TTFT,
    "vllm:inter_token_latency_seconds": _ITL,
    "vllm:time_per_output_token_seconds": _ITL,  # vLLM V1's edges for it (V0's stopped at 2.5)
    "vllm:request_time_per_output_token_seconds": _ITL,
    "vllm:e2e_request_latency_seconds": _LATENCY,
    "vllm:request_queue_time_seconds": _LATENCY,
    "vllm:request_inference_time_seconds": _LATENCY,
    "vllm:request_prefill_time_seconds": _LATENCY,
    "vllm:request_decode_time_seconds": _LATENCY,
    "vllm:request_prefill_kv_computed_tokens": _TOKENS_256,
}


def families(logger: PrometheusStatLogger) -> dict:
    text = generate_latest(logger.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def labels_of(family) -> set[str]:
    return {k for s in family.samples for k in s.labels} - {"le"}


def exposed(logger: PrometheusStatLogger) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {name: (f.type, tuple(sorted(labels_of(f) - set(BASE)))) for name, f in families(logger).items()}


def config(model_dir, **kw):
    return EngineArgs(model=str(model_dir), max_model_len=256, **kw).create_engine_config()


def test_every_vllm_series_and_no_other(llama_model_dir):
    cfg = config(llama_model_dir)
    logger = PrometheusStatLogger("m", config=cfg)
    assert exposed(logger) == VLLM_SERIES | VLLM_OLDER_SERIES
    logger.log_engine_initialized(cfg, 100)  # vLLM's log_engine_initialized adds the cache info
    got = families(logger)
    info = got["vllm:cache_config_info"]  # labels: the cache config's fields, num_gpu_blocks and engine
    assert info.type == "gauge" and {"engine", "num_gpu_blocks", "block_size"} <= labels_of(info)
    assert set(got) == set(VLLM_SERIES) | set(VLLM_OLDER_SERIES) | {"vllm:cache_config_info"}


def test_spec_decode_series_come_with_a_speculative_config(llama_model_dir):
    logger = PrometheusStatLogger(
        "m", config=config(llama_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    )
    assert exposed(logger) == VLLM_SERIES | VLLM_OLDER_SERIES | VLLM_SPEC_SERIES
    per_pos = families(logger)["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert {s.labels["position"] for s in per_pos.samples} == {"0", "1"}  # one per proposed token


def test_base_labels_label_values_and_bucket_edges(llama_model_dir):
    got = families(PrometheusStatLogger("m", config=config(llama_model_dir)))
    for name, family in got.items():
        assert set(BASE) <= labels_of(family), name
        for label, values in VLLM_LABEL_VALUES.items():
            if label in labels_of(family):
                assert {s.labels[label] for s in family.samples} == values, name
    for name, edges in VLLM_BUCKETS.items():
        les = [s.labels["le"] for s in got[name].samples if s.name.endswith("_bucket")]
        assert les == [*(str(float(e)) for e in edges), "+Inf"], name


def test_older_names_carry_the_same_values_as_todays(llama_model_dir):
    """vllm:gpu_cache_usage_perc is vllm:kv_cache_usage_perc; vllm:time_per_output_token_seconds
    gets every inter-token latency observation. A counter's family name (vllm:request_success)
    is exposed, as in vLLM, only as vllm:request_success_total: what dashboards query."""
    from pagedllm.engine.protocol import SchedulerStats
    from pagedllm.metrics.stats import IterationStats

    logger = PrometheusStatLogger("m", config=config(llama_model_dir))
    logger.record(SchedulerStats(kv_cache_usage=0.25), IterationStats(inter_token_latencies=[0.02, 0.3, 0.3]))
    text = generate_latest(logger.registry).decode()
    samples = {
        (s.name, s.labels.get("le")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith(("vllm:gpu_cache", "vllm:kv_cache", "vllm:time_per", "vllm:inter_token"))
    }
    assert samples[("vllm:gpu_cache_usage_perc", None)] == samples[("vllm:kv_cache_usage_perc", None)] == 0.25
    for suffix, le in (("_count", None), ("_sum", None), ("_bucket", "0.025"), ("_bucket", "0.4"), ("_bucket", "+Inf")):
        old = samples[(f"vllm:time_per_output_token_seconds{suffix}", le)]
        assert old == samples[(f"vllm:inter_token_latency_seconds{suffix}", le)], (suffix, le)
    assert samples[("vllm:time_per_output_token_seconds_count", None)] == 3
    assert "vllm:request_success_total{" in text and "\nvllm:request_success{" not in text
