"""vllm:lora_requests_info from the scheduler's per-adapter counts (no model)."""

from __future__ import annotations

from prometheus_client import generate_latest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.protocol import SchedulerStats
from pagedllm.lora.request import LoRARequest
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def _scheduler(max_loras: int) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, policy="fcfs")
    return Scheduler(config, CacheConfig(16, None, 0.9, False), 64, max_loras=max_loras)


def _request(i: int, lora: LoRARequest | None) -> Request:
    return Request(str(i), [1, 2, 3], SamplingParams(max_tokens=4), None, lora_request=lora)


def test_scheduler_admits_max_loras_adapters_and_reports_them():
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    scheduler = _scheduler(max_loras=1)
    for i, lora in enumerate([a, b, a, None]):
        scheduler.add_request(_request(i, lora))
    out = scheduler.schedule()
    # "b" waits for the slot; the later "a" may not overtake it; the base request may.
    assert sorted(out.num_scheduled_tokens) == ["0", "3"]
    assert [r.request_id for r in scheduler.waiting] == ["1", "2"]
    stats = scheduler.make_stats()
    assert stats.running_lora_adapters == {"a": 1} and stats.waiting_lora_adapters == {"b": 1, "a": 1}


def test_prometheus_lora_requests_info(llama_model_dir):
    from pagedllm.config import EngineArgs
    from pagedllm.metrics.prometheus import PrometheusStatLogger
    from pagedllm.metrics.stats import IterationStats

    config = EngineArgs(str(llama_model_dir), enable_lora=True, max_loras=2).create_engine_config()
    logger = PrometheusStatLogger("m", config=config)
    logger.record(
        SchedulerStats(running_lora_adapters={"a": 2, "b": 1}, waiting_lora_adapters={"c": 1}), IterationStats()
    )
    text = generate_latest(logger.registry).decode()
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"}' in text
    assert "lora_requests_info" not in generate_latest(PrometheusStatLogger("m").registry).decode()
