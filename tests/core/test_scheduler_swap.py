"""The scheduler with a swap tier: exact block ids, slots and copies; no model, no torch.

``SwapFakeModel`` extends the simulated KV cache of test_scheduler's ``FakeModel`` with a tier:
each step runs the SchedulerOutput's swap-outs, then its swap-ins, then the writes. A tier hit
restored from a stale slot or into the wrong block fails the KV check of the step it happens in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from tests.core.test_scheduler import BS, FakeModel, make_request, new_reqs, run_to_completion, step


class SwapFakeModel(FakeModel):
    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler)
        self.tier: dict[int, list] = {}  # slot -> the block's simulated KV

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        # The worker's order: swap-outs, copy-on-write copies, swap-ins, then the forward.
        for block_id, slot in out.kv_swap_out:
            self.tier[slot] = list(self.kv[block_id])
        super().copy_kv(out)
        for block_id, slot in out.kv_swap_in:
            self.kv[block_id] = list(self.tier[slot])
        return super().execute(dataclasses.replace(out, kv_block_copies=[]))


@pytest.fixture
def schedulers() -> Iterator[list[Scheduler]]:
    made: list[Scheduler] = []
    yield made
    for scheduler in made:
        scheduler.check_integrity()
        assert not scheduler.has_unfinished_requests()


def make(made: list[Scheduler], num_blocks: int, num_swap_blocks: int, max_num_seqs: int = 16) -> Scheduler:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs, 2048, 1024, "fcfs", 0),
        CacheConfig(BS, None, 0.9, True),
        num_blocks,
        num_swap_blocks=num_swap_blocks,
    )
    made.append(scheduler)
    return scheduler


def test_evicted_prefix_is_restored_from_the_tier(schedulers) -> None:
    sched = make(schedulers, num_blocks=5, num_swap_blocks=4)
    model = SwapFakeModel(sched)
    prompt = list(range(500, 533))  # two full blocks + one token
    sched.add_request(make_request("A", prompt, max_tokens=1))
    run_to_completion(sched, model)
    sched.add_request(make_request("B", 64, max_tokens=1))  # four blocks: evicts A's
    out, _ = step(sched, model)
    assert out.kv_swap_out == [(2, 0), (1, 1)] and out.kv_swap_in == []
    run_to_completion(sched, model)

    sched.add_request(make_request("A2", prompt, max_tokens=2))
    out, outputs = step(sched, model)
    assert new_reqs(out) == [("A2", [1, 2, 3], 32)] and out.num_scheduled_tokens == {"A2": 1}
    assert out.kv_swap_out == [(1, 2), (2, 3)] and out.kv_swap_in == [(1, 1), (2, 0)]
    assert outputs.outputs[0].num_cached_tokens == 32
    stats = outputs.scheduler_stats
    assert stats is not None
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (33, 32)
    assert (stats.kv_swap_out_blocks, stats.kv_swap_in_blocks) == (2, 2)
    out, _ = step(sched, model)  # a decode step: no copies
    assert (out.kv_swap_out, out.kv_swap_in) == ([], [])


def test_head_of_line_request_waits_without_leaking_its_tier_hits(schedulers) -> None:
    sched = make(schedulers, num_blocks=5, num_swap_blocks=4)
    model = SwapFakeModel(sched)
    prompt = list(range(500, 533))
    sched.add_request(make_request("A", prompt, max_tokens=1))
    run_to_completion(sched, model)
    sched.add_request(make_request("B", 64, max_tokens=1))
    run_to_completion(sched, model)
    sched.add_request(make_request("H", 20, max_tokens=3))  # holds two blocks for three steps
    step(sched, model)

    # A2 hits both A blocks in the tier but needs three blocks, and two are free: it waits.
    sched.add_request(make_request("A2", prompt, max_tokens=1))
    out, _ = step(sched, model)
    assert out.num_scheduled_tokens == {"H": 1} and (out.kv_swap_out, out.kv_swap_in) == ([], [])
    sched.check_integrity()
    done = run_to_completion(sched, model)
    assert done["A2"][0].num_cached_tokens == 32  # admitted once H finished: restored then


def test_swap_in_of_a_block_evicted_in_the_same_step(schedulers) -> None:
    """One step admits C, whose allocation evicts A's cached block 1 to the tier, then A2, whose
    tier hit is that very block: its swap-out must run before C's prefill overwrites block 1 and
    before A2's swap-in reads the slot."""
    sched = make(schedulers, num_blocks=6, num_swap_blocks=8)
    model = SwapFakeModel(sched)
    a_prompt = list(range(500, 517))  # one full block + one token
    sched.add_request(make_request("A", a_prompt, max_tokens=1))
    run_to_completion(sched, model)  # A's [1, 2] freed: queue [3, 4, 5, 2, 1]
    sched.add_request(make_request("F", 48, max_tokens=1))
    run_to_completion(sched, model)  # F's [3, 4, 5] freed: queue [2, 1, 5, 4, 3]
    sched.add_request(make_request("C", 20, max_tokens=1))
    sched.add_request(make_request("A2", a_prompt, max_tokens=1))
    out, outputs = step(sched, model)
    assert new_reqs(out) == [("C", [2, 1], 0), ("A2", [5, 4], 16)]
    assert out.kv_swap_out == [(1, 0), (5, 1), (4, 2)] and out.kv_swap_in == [(5, 0)]
    assert {o.request_id: o.num_cached_tokens for o in outputs.outputs} == {"C": 0, "A2": 16}
    run_to_completion(sched, model)


def test_no_tier_recomputes(schedulers) -> None:
    sched = make(schedulers, num_blocks=5, num_swap_blocks=0)
    model = SwapFakeModel(sched)
    prompt = list(range(500, 533))
    for req_id, length in (("A", prompt), ("B", 64)):
        sched.add_request(make_request(req_id, length, max_tokens=1))
        run_to_completion(sched, model)
    sched.add_request(make_request("A2", prompt, max_tokens=1))
    out, outputs = step(sched, model)
    assert new_reqs(out) == [("A2", [1, 2, 3], 0)] and (out.kv_swap_out, out.kv_swap_in) == ([], [])
    assert outputs.outputs[0].num_cached_tokens == 0
