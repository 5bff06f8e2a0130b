"""The metrics of a real engine: a tiny model behind AsyncLLM (the engine core in its own
process, as the server runs it), read from the Prometheus logger's exposition.

Requests ignore EOS, so each sequence makes exactly max_tokens tokens and the counts are exact.
Phase 1 runs requests one at a time (nothing is preempted): the tokens the engine computed per
step then add up to exactly the uncached prompt tokens plus every generated token but each
sequence's last. Phase 2 bursts requests into a pool too small for them (preemptions), phase 3
aborts a stream. The engine core's clock (events, step timestamps) and the front end's (arrival,
receipt) are the same CLOCK_MONOTONIC, so TTFT >= queue + prefill and e2e >= queue + inference.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.sampling_params import SamplingParams
from tests.metrics.test_prometheus import samples, value

SHARED = list(range(10, 58))  # three full blocks of 16


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


async def run(engine: AsyncLLM, request_id: str, prompt: list[int], sampling: SamplingParams) -> None:
    async for _ in engine.generate({"prompt_token_ids": prompt}, sampling, request_id):
        pass


async def wait_idle(engine: AsyncLLM, logger: PrometheusStatLogger) -> dict:
    """The exposition once the engine's idle-step stats have arrived."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        data = samples(logger)
        if value(data, "vllm:num_requests_running") == 0 and value(data, "vllm:num_requests_waiting") == 0:
            return data
        await asyncio.sleep(0.05)
    raise AssertionError("the engine did not go idle")


def count(data: dict, name: str) -> float:
    return value(data, f"vllm:{name}_count")


def total(data: dict, name: str) -> float:
    return value(data, f"vllm:{name}_sum")


def check_request_metrics(data: dict, seqs: int, users: int, prompt: int, gen: int, n_sum: int, max_gen: int) -> None:
    assert value(data, "vllm:request_success_total", finished_reason="length") == seqs
    assert (count(data, "request_prompt_tokens"), total(data, "request_prompt_tokens")) == (seqs, prompt)
    assert (count(data, "request_generation_tokens"), total(data, "request_generation_tokens")) == (seqs, gen)
    assert (count(data, "request_params_max_tokens"), total(data, "request_params_max_tokens")) == (seqs, gen)
    assert (count(data, "request_params_n"), total(data, "request_params_n")) == (users, n_sum)
    assert (count(data, "request_max_num_generation_tokens"), total(data, "request_max_num_generation_tokens")) == (
        users,
        max_gen,
    )
    assert value(data, "vllm:prompt_tokens_total") == prompt
    assert value(data, "vllm:generation_tokens_total") == gen
    local = value(data, "vllm:prompt_tokens_by_source_total", source="local_compute")
    cached = value(data, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert local + cached == prompt and value(data, "vllm:prompt_tokens_cached_total") == cached
    assert value(data, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert total(data, "request_prefill_kv_computed_tokens") == local
    assert count(data, "time_to_first_token_seconds") == seqs
    assert count(data, "inter_token_latency_seconds") == gen - seqs  # one per token after a sequence's first


def check_phases(data: dict, seqs: int) -> None:
    for name in ("queue", "prefill", "decode", "inference"):
        assert count(data, f"request_{name}_time_seconds") == seqs
        assert value(data, f"vllm:request_{name}_time_seconds_bucket", le="0.3") <= seqs
    queue, prefill = total(data, "request_queue_time_seconds"), total(data, "request_prefill_time_seconds")
    decode, inference = total(data, "request_decode_time_seconds"), total(data, "request_inference_time_seconds")
    assert min(queue, prefill, decode) >= 0 and decode > 0
    assert inference == pytest.approx(prefill + decode)
    assert total(data, "time_to_first_token_seconds") >= queue + prefill
    assert total(data, "e2e_request_latency_seconds") >= queue + inference
    assert count(data, "request_time_per_output_token_seconds") == seqs  # every sequence made > 1 token
    tpot = total(data, "request_time_per_output_token_seconds")
    assert 0 < tpot <= decode


def check_idle_gauges(data: dict) -> None:
    for reason in ("capacity", "deferred"):
        assert value(data, "vllm:num_requests_waiting_by_reason", reason=reason) == 0
    assert value(data, "vllm:engine_sleep_state", sleep_state="awake") == 1


async def phase_one(engine: AsyncLLM, logger: PrometheusStatLogger) -> None:
    """One request at a time, three sharing a three-block prefix, one with n = 2."""
    for i in range(3):
        await run(engine, f"shared-{i}", SHARED + [60 + i] * 5, params(8))
    await run(engine, "pair", list(range(70, 90)), params(5, n=2, temperature=1.0, seed=3))
    data = await wait_idle(engine, logger)
    check_request_metrics(data, seqs=5, users=4, prompt=3 * 53 + 2 * 20, gen=3 * 8 + 2 * 5, n_sum=5, max_gen=29)
    check_phases(data, seqs=5)
    check_idle_gauges(data)
    assert value(data, "vllm:num_preemptions_total") == 0
    cached = value(data, "vllm:prompt_tokens_cached_total")
    assert cached >= 2 * 48 and value(data, "vllm:prefix_cache_hits_total") >= cached
    local = value(data, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert total(data, "iteration_tokens_total") == local + (3 * 8 + 2 * 5) - 5
    assert count(data, "iteration_tokens_total") >= 3 * 8 + 5  # at least one step per token of the longest


async def phase_two(engine: AsyncLLM, logger: PrometheusStatLogger) -> None:
    """Six requests that outgrow the 23-block pool together: some are preempted and recomputed."""
    burst = [run(engine, f"burst-{i}", list(range(100 + 40 * i, 140 + 40 * i)), params(100)) for i in range(6)]
    await asyncio.gather(*burst)
    data = await wait_idle(engine, logger)
    prompt, gen = 3 * 53 + 2 * 20 + 6 * 40, 3 * 8 + 2 * 5 + 6 * 100
    check_request_metrics(data, seqs=11, users=10, prompt=prompt, gen=gen, n_sum=11, max_gen=29 + 600)
    check_phases(data, seqs=11)
    check_idle_gauges(data)
    assert value(data, "vllm:num_preemptions_total") > 0
    local = value(data, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert total(data, "iteration_tokens_total") >= local + gen - 11  # recomputes come on top


async def phase_three(engine: AsyncLLM, logger: PrometheusStatLogger) -> None:
    """A stream closed after its first output is aborted: counted once, as abort."""
    stream = engine.generate({"prompt_token_ids": list(range(400, 420))}, params(200), "dropped")
    await anext(stream)
    await stream.aclose()
    data = await wait_idle(engine, logger)
    assert value(data, "vllm:request_success_total", finished_reason="abort") == 1
    assert count(data, "e2e_request_latency_seconds") == 12
    assert count(data, "request_params_n") == 11  # the aborted request is one more user request
    assert count(data, "request_queue_time_seconds") == 12  # it was scheduled and made a token


def test_engine_metrics_are_measured(llama_model_dir):
    # 24 blocks of 16 tokens (one is the null block): one request of max_model_len fits, six of phase 2 do not.
    config = EngineArgs(model=str(llama_model_dir), max_model_len=256, num_gpu_blocks_override=24).create_engine_config(
        "serve"
    )
    logger = PrometheusStatLogger("tiny", config=config)

    async def main() -> None:
        engine = AsyncLLM(config, stat_loggers=[logger])
        try:
            info = [dict(k[1]) for k in samples(logger) if k[0] == "vllm:cache_config_info"]
            assert info[0]["num_gpu_blocks"] == str(engine.capacity["num_blocks"]) == "24"
            await phase_one(engine, logger)
            await phase_two(engine, logger)
            await phase_three(engine, logger)
            assert await engine.call_utility("check_integrity") is True
        finally:
            engine.shutdown()

    asyncio.run(main())
