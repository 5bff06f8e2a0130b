"""Data parallelism without processes: the router (least loaded, prefix affinity, affinity
yielding to load), the config checks, the offline refusal and the per-engine metric series."""

from __future__ import annotations

import re

import pytest
from prometheus_client import generate_latest

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.config.parallel import ParallelArgs
from pagedllm.engine.dp_router import AFFINITY_SLACK, DPRouter
from pagedllm.engine.protocol import SchedulerStats
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.stats import IterationStats

BLOCK = 4
A = [1, 2, 3, 4, 50, 51]  # these two share their first block
A2 = [1, 2, 3, 4, 60]
B = [9, 8, 7, 6, 5]


def test_least_loaded_uses_reports_plus_requests_sent_since():
    router = DPRouter(3, block_size=None)
    router.report(0, num_running=3, num_waiting=1)
    router.report(1, num_running=1, num_waiting=0)
    router.report(2, num_running=2, num_waiting=0)
    assert [router.route([i]) for i in range(3)] == [1, 1, 2]  # loads 4,1,2 -> 4,2,2 -> 4,3,2 (tie: lowest index)
    assert [router.load(i) for i in range(3)] == [4, 3, 3]
    router.report(1, num_running=0, num_waiting=0)  # a fresh report replaces what was counted since
    assert router.load(1) == 0 and router.least_loaded() == 1


def test_an_idle_burst_alternates_between_cores():
    router = DPRouter(2, block_size=None)
    assert [router.route([i]) for i in range(6)] == [0, 1, 0, 1, 0, 1]


def test_a_shared_first_block_goes_to_the_core_that_served_it():
    router = DPRouter(2, block_size=BLOCK)
    first = router.route(A)
    assert router.route(B) != first  # load alone: the other core
    router.report(first, 1, 0)
    router.report(1 - first, 0, 0)
    assert router.route(A2) == first  # busier, but it holds the prefix
    assert router.route(B) == 1 - first


def test_salt_and_adapter_partition_the_affinity():
    router = DPRouter(2, block_size=BLOCK)
    assert router.prefix_key(A, None, None) == router.prefix_key(A2, None, None)
    assert router.prefix_key(A, "s", None) != router.prefix_key(A, None, None)
    assert router.prefix_key(A, None, "lora1") != router.prefix_key(A, None, None)
    assert router.prefix_key(A[: BLOCK - 1], None, None) is None  # under one block: load alone
    assert DPRouter(2, block_size=None).prefix_key(A, None, None) is None  # no prefix caching


def test_affinity_yields_when_its_core_is_much_busier():
    router = DPRouter(2, block_size=BLOCK)
    owner = router.route(A)
    other = 1 - owner
    router.report(other, 1, 0)
    router.report(owner, 2 * 1 + AFFINITY_SLACK, 0)  # at the limit: stays
    assert router.route(A2) == owner
    router.report(owner, 2 * 1 + AFFINITY_SLACK + 1, 0)  # beyond: goes to the least loaded ...
    assert router.route(A2) == other
    router.report(owner, 0, 0)
    router.report(other, 0, 0)
    assert router.route(A) == other  # ... which now owns the prefix


def test_the_affinity_map_is_bounded_lru():
    router = DPRouter(2, block_size=1, max_entries=2)
    for token in (1, 2, 3):
        router.route([token])
    assert len(router._owners) == 2 and router.prefix_key([1], None, None) not in router._owners


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"data_parallel_size": 0}, "data_parallel_size must be a positive integer"),
        ({"data_parallel_size": 2, "tensor_parallel_size": 2}, "not both"),
    ],
)
def test_bad_data_parallel_settings_say_what_works(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ParallelArgs(**kwargs).create_parallel_config()


def test_data_parallel_is_cpu_only(llama_model_dir):
    with pytest.raises(ValueError, match=re.escape("runs on CPU only")):
        EngineArgs(model=str(llama_model_dir), data_parallel_size=2, device="cuda").create_engine_config()


def test_offline_llm_refuses_data_parallelism_and_names_the_server(llama_model_dir):
    with pytest.raises(ValueError, match=re.escape("pagedllm serve MODEL --data-parallel-size 2")):
        LLM(str(llama_model_dir), data_parallel_size=2)


def _samples(text: str, name: str) -> dict[str, float]:
    """engine label -> value of the series ``name`` (one series per engine)."""
    pattern = re.compile(rf'^{re.escape(name)}\{{[^}}]*engine="(\d+)"[^}}]*\}} (\S+)$', re.M)
    return {engine: float(value) for engine, value in pattern.findall(text)}


def test_each_engine_core_has_its_own_series():
    logger = PrometheusStatLogger("tiny", num_engines=2)
    logger.record(SchedulerStats(num_running_reqs=3), IterationStats(num_generation_tokens=5), engine_idx=1)
    logger.record(SchedulerStats(num_running_reqs=1), IterationStats(num_generation_tokens=2), engine_idx=0)
    text = generate_latest(logger.registry).decode()
    assert _samples(text, "vllm:num_requests_running") == {"0": 1.0, "1": 3.0}
    assert _samples(text, "vllm:generation_tokens_total") == {"0": 2.0, "1": 5.0}
    assert set(_samples(text, "vllm:prompt_tokens_total")) == {"0", "1"}  # every series exists per engine
