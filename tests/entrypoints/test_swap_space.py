"""--swap-space end to end on a tiny model: a prompt's prefix blocks are evicted by other prompts,
then the prompt comes back. With a swap tier its blocks are restored (cached tokens > 0) and the
greedy tokens are those of a run without one, which recomputes them."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from pagedllm import LLM, RequestOutput, SamplingParams
from pagedllm.config import CacheArgs, EngineArgs
from pagedllm.engine.protocol import SchedulerStats
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.stats import IterationStats
from tests.engine_checks import assert_idle_and_intact

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Token ids, not text: the block count is exact. 64 prompt tokens = 4 blocks of 16.
LONG = [{"prompt_token_ids": [(37 * i) % 500 + 5 for i in range(64)]}]
OTHERS = [{"prompt_token_ids": [(11 * i + 7 * k) % 500 + 5 for i in range(64)]} for k in range(1, 4)]


def run(llm: LLM) -> tuple[list[int], RequestOutput]:
    """(the first run's tokens, the repeat's output), the pool checked at the end."""
    first = llm.generate(LONG, GREEDY)[0]
    for other in OTHERS:  # one at a time: each takes the blocks the last one freed
        llm.generate([other], GREEDY)
    again = llm.generate(LONG, GREEDY)[0]
    assert_idle_and_intact(llm)
    return first.outputs[0].token_ids, again


@pytest.fixture(scope="module")
def baseline(llama_model_dir) -> tuple[list[int], RequestOutput]:
    # 6 usable blocks of 16 tokens: one 72-token request at a time, no room for a second prefix.
    return run(LLM(str(llama_model_dir), max_model_len=80, num_gpu_blocks_override=7))


def test_without_swap_space_the_evicted_prefix_is_recomputed(baseline) -> None:
    first, again = baseline
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first


def test_with_swap_space_the_evicted_prefix_is_restored(llama_model_dir, baseline) -> None:
    llm = LLM(str(llama_model_dir), max_model_len=80, num_gpu_blocks_override=7, swap_space=0.01)
    tier = llm.llm_engine.engine_core.scheduler.kv_cache_manager.swap_tier
    assert tier.num_slots > 16
    first, again = run(llm)
    assert again.num_cached_tokens == 48  # the 3 full blocks before the last token's came back
    assert first == again.outputs[0].token_ids == baseline[0]


@pytest.mark.parametrize("gib", [-1.0, float("nan"), 1e9])
def test_bad_swap_space_is_a_value_error(gib: float) -> None:
    with pytest.raises(ValueError, match="swap.space"):
        CacheArgs(swap_space=gib).create_cache_config("cpu")


def test_swap_counters_only_with_a_swap_tier(llama_model_dir) -> None:
    def exposition(swap_space: float = 0.0) -> str:
        config = EngineArgs(model=str(llama_model_dir), max_model_len=80, swap_space=swap_space).create_engine_config()
        logger = PrometheusStatLogger("m", config=config)
        logger.record(SchedulerStats(kv_swap_out_blocks=3, kv_swap_in_blocks=2), IterationStats())
        return generate_latest(logger.registry).decode()

    assert "swap" not in exposition()
    text = exposition(0.01)
    assert 'pagedllm:kv_swap_out_blocks_total{engine="0",model_name="m"} 3.0' in text
    assert 'pagedllm:kv_swap_in_blocks_total{engine="0",model_name="m"} 2.0' in text


def test_with_a_draft_model_both_models_caches_are_restored(llama_model_dir, baseline) -> None:
    """The draft model is the target itself, so with its KV restored intact every proposal is
    accepted; a draft cache left out of the swap-in would show as rejections."""
    spec = {"method": "draft_model", "model": str(llama_model_dir), "num_speculative_tokens": 2}
    llm = LLM(
        str(llama_model_dir), max_model_len=80, num_gpu_blocks_override=7, swap_space=0.01, speculative_config=spec
    )
    first, again = run(llm)
    assert again.num_cached_tokens == 48 and first == again.outputs[0].token_ids == baseline[0]
    assert again.metrics.spec_acceptance_rate == 1.0
