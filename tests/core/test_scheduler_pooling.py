"""Pooling requests in the scheduler (no model, no torch): a request ends with its embedding
the step its prompt is computed; MEAN/CLS pooling never starts from a prefix-cache hit; an
encoder's prompt (chunked_prefill off) runs whole or waits."""

from __future__ import annotations

import dataclasses

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.protocol import FinishReason
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 16


def _scheduler(budget: int = 64, chunked: bool = True, caching: bool = True, num_blocks: int = 32) -> Scheduler:
    config = SchedulerConfig(8, budget, 256, "fcfs", chunked_prefill=chunked)
    return Scheduler(config, CacheConfig(BS, None, 0.9, caching), num_blocks)


def _pooling(request_id: str, prompt: list[int], pooling_type: str = "LAST") -> Request:
    params = dataclasses.replace(PoolingParams(), pooling_type=pooling_type)
    return Request(request_id, prompt, SamplingParams(max_tokens=1), None, pooling_params=params)


def _pool_ended(sched: SchedulerOutput) -> ModelRunnerOutput:
    """What a pooling worker reports: an embedding for each prompt that ends in the step."""
    out = ModelRunnerOutput(sampled_token_ids={})
    for new in sched.scheduled_new_reqs:
        if new.num_computed_tokens + sched.num_scheduled_tokens[new.req_id] == len(new.prompt_token_ids):
            out.pooler_output[new.req_id] = b"\x00\x00\x80\x3f"  # [1.0]
    return out


def test_pooling_request_ends_with_its_embedding_and_frees_its_blocks():
    scheduler = _scheduler(budget=24)
    scheduler.add_request(_pooling("a", list(range(100, 140))))  # 40 tokens: two chunks of 24 + 16
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 24}
    outputs = scheduler.update_from_output(first, ModelRunnerOutput(sampled_token_ids={}))
    assert outputs.outputs == []  # a chunk reports nothing
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 16}
    out = ModelRunnerOutput(sampled_token_ids={}, pooler_output={"a": b"\x00\x00\x80\x3f"})
    [done] = scheduler.update_from_output(second, out).outputs
    assert done.finish_reason == FinishReason.STOP and done.pooling_output == b"\x00\x00\x80\x3f"
    assert done.new_token_ids == [] and not scheduler.running and not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.usage == 0.0
    scheduler.check_integrity()


def test_mean_pooling_skips_the_prefix_cache_last_pooling_uses_it():
    scheduler = _scheduler()
    prompt = list(range(100, 140))
    for req_id in ("warm", "last", "mean"):
        pooling_type = "MEAN" if req_id == "mean" else "LAST"
        scheduler.add_request(_pooling(req_id, prompt, pooling_type))
        sched = scheduler.schedule()
        scheduler.update_from_output(sched, _pool_ended(sched))
        new = sched.scheduled_new_reqs[0]
        if req_id == "last":
            assert new.num_computed_tokens == 32  # two full cached blocks
        if req_id == "mean":
            assert new.num_computed_tokens == 0 and sched.num_scheduled_tokens["mean"] == 40
    scheduler.check_integrity()


def test_unchunked_prompt_waits_for_a_step_with_room_for_all_of_it():
    scheduler = _scheduler(budget=48, chunked=False, caching=False)
    scheduler.add_request(_pooling("a", list(range(100, 130))))  # 30
    scheduler.add_request(_pooling("b", list(range(200, 230))))  # 30: does not fit beside a
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 30}
    scheduler.update_from_output(first, _pool_ended(first))
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"b": 30}
    scheduler.update_from_output(second, _pool_ended(second))
    assert not scheduler.has_unfinished_requests()
    scheduler.check_integrity()
