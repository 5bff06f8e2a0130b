"""The scheduler with batches in flight (pipeline stages): no model, no torch.

The engine core submits a batch and schedules the next before the first comes back. The
scheduler must split the requests between the batches, never schedule a request whose previous
step is still out (its next token is unknown), never take the blocks of a request in flight, and
free an aborted request's blocks exactly once, after its last batch returns. ``FakeModel`` runs
each batch when it is submitted, in order, as every stage does; its simulated KV cache fails a
test that reads stale KV.
"""

from __future__ import annotations

from collections import deque

from core.test_scheduler import BS, FakeModel, make_request
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step_plan import PipelineShape
from pagedllm.engine.protocol import EngineCoreOutput
from pagedllm.request import RequestStatus


def make(num_blocks: int = 100, in_flight: int = 2, max_num_batched_tokens: int = 2048) -> Scheduler:
    return Scheduler(
        SchedulerConfig(16, max_num_batched_tokens, 1024, "fcfs", 0),
        CacheConfig(block_size=BS, kv_cache_memory_bytes=None, gpu_memory_utilization=0.9, enable_prefix_caching=True),
        num_blocks,
        pipeline=PipelineShape(num_stages=2, max_batches_in_flight=in_flight),
    )


def run_pipelined(sched: Scheduler, model: FakeModel, depth: int = 2) -> tuple[dict[str, list[int]], int]:
    """The engine core's loop: submit while there is room and work, else collect the oldest.
    Returns each request's tokens and the most batches that were in flight at once."""
    queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    tokens: dict[str, list[int]] = {}
    peak = 0
    for _ in range(1000):
        if not sched.has_unfinished_requests() and not queue:
            sched.check_integrity()
            return tokens, peak
        submitted = False
        if len(queue) < depth and sched.has_unfinished_requests():
            out = sched.schedule()
            _check_not_in_flight(sched, out, queue)
            if not out.is_empty or not queue:
                queue.append((out, model.execute(out)))
                submitted = not out.is_empty
            peak = max(peak, len(queue))
        if queue and (len(queue) >= depth or not submitted):
            outputs = sched.update_from_output(*queue.popleft())
            _collect(tokens, outputs.outputs)
    raise AssertionError("requests did not finish")


def _check_not_in_flight(sched: Scheduler, out: SchedulerOutput, queue: deque) -> None:
    """A request in a batch in flight is scheduled again only for more of its prompt (the
    previous chunk samples nothing), never for a token that batch has yet to sample."""
    in_flight = {r for o, _ in queue for r in o.num_scheduled_tokens}
    cached = out.scheduled_cached_reqs
    start = dict(zip(cached.req_ids, cached.num_computed_tokens))
    for rid in in_flight & set(out.num_scheduled_tokens):
        assert start[rid] < sched.requests[rid].num_prompt_tokens, f"{rid} scheduled again while in flight"


def _collect(tokens: dict[str, list[int]], outputs: list[EngineCoreOutput]) -> None:
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)


def test_two_batches_hold_different_requests_and_carry_the_sampled_tokens() -> None:
    sched = make()
    model = FakeModel(sched)
    for rid in "ABCD":
        sched.add_request(make_request(rid, 20, max_tokens=4))
    first, second = sched.schedule(), sched.schedule()
    assert list(first.num_scheduled_tokens) == ["A", "B"]  # half the requests each
    assert list(second.num_scheduled_tokens) == ["C", "D"]
    assert sched.schedule().is_empty  # every request is in flight
    outputs = sched.update_from_output(first, model.execute(first))
    assert [o.request_id for o in outputs.outputs] == ["A", "B"]
    model.execute(second)  # batch 2 ran on the first stage while batch 1 finished
    third = sched.schedule()  # A and B are known again: their decode step, with the token drawn
    cached = third.scheduled_cached_reqs
    assert cached.req_ids == ["A", "B"] and cached.new_token_ids == [[7], [7]]
    assert third.num_scheduled_tokens == {"A": 1, "B": 1}


def test_pipelined_run_matches_one_batch_at_a_time() -> None:
    def prompts(sched: Scheduler) -> None:
        for i in range(7):
            sched.add_request(make_request(f"R{i}", 5 + 9 * i, max_tokens=3 + i % 4))

    # A small budget: long prompts are chunked, and a chunk may follow one in flight.
    serial, pipelined = make(in_flight=1, max_num_batched_tokens=40), make(max_num_batched_tokens=40)
    prompts(serial)
    prompts(pipelined)
    expected, _ = run_pipelined(serial, FakeModel(serial), depth=1)
    got, peak = run_pipelined(pipelined, FakeModel(pipelined))
    assert got == expected and peak == 2
    assert {len(t) for t in got.values()} == {3, 4, 5, 6}


def test_abort_in_flight_frees_its_blocks_once_after_its_batch_returns() -> None:
    sched = make(num_blocks=10)
    model = FakeModel(sched)
    sched.add_request(make_request("A", 20, max_tokens=8))
    sched.add_request(make_request("B", 20, max_tokens=8))
    first = sched.schedule()
    assert list(first.num_scheduled_tokens) == ["A"]
    runner_output = model.execute(first)
    a_blocks = sched.kv_cache_manager.get_block_ids("A")
    sched.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)  # twice: still one free
    assert sched.requests["A"].status == RequestStatus.FINISHED_ABORTED and sched.running == []
    assert sched.kv_cache_manager.get_block_ids("A") == a_blocks  # its batch may still write them
    sched.check_integrity()
    second = sched.schedule()
    assert list(second.num_scheduled_tokens) == ["B"] and "A" not in second.finished_req_ids
    free_before = sched.kv_cache_manager.num_free_blocks
    outputs = sched.update_from_output(first, runner_output)
    assert outputs.outputs == []  # an aborted request reports nothing more
    assert sched.kv_cache_manager.num_free_blocks == free_before + len(a_blocks)
    assert "A" not in sched.requests and "A" not in sched.kv_cache_manager.req_to_blocks
    sched.update_from_output(second, model.execute(second))
    third = sched.schedule()
    assert third.finished_req_ids == {"A"}  # the workers drop it after every batch that held it
    _collect({}, sched.update_from_output(third, model.execute(third)).outputs)
    sched.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert sched.kv_cache_manager.num_free_blocks == 9


def test_preemption_waits_for_a_victim_in_flight() -> None:
    """Four usable blocks, two 32-token prompts: A's first decode needs a fifth block, and the
    request to preempt for it (B, the latest) is in flight, so A waits a step rather than take
    blocks a batch still writes; once B is back, B is preempted."""
    sched = make(num_blocks=5)
    model = FakeModel(sched)
    sched.add_request(make_request("A", 32, max_tokens=4))
    sched.add_request(make_request("B", 32, max_tokens=4))
    first, second = sched.schedule(), sched.schedule()
    assert list(first.num_scheduled_tokens) == ["A"] and list(second.num_scheduled_tokens) == ["B"]
    assert sched.kv_cache_manager.num_free_blocks == 0
    out_first, out_second = model.execute(first), model.execute(second)
    tokens: dict[str, list[int]] = {}
    _collect(tokens, sched.update_from_output(first, out_first).outputs)
    blocked = sched.schedule()
    assert blocked.is_empty and not blocked.preempted_req_ids
    assert sched.requests["B"].status == RequestStatus.RUNNING
    _collect(tokens, sched.update_from_output(second, out_second).outputs)
    fourth = sched.schedule()
    assert fourth.preempted_req_ids == {"B"} and fourth.num_scheduled_tokens == {"A": 1}
    _collect(tokens, sched.update_from_output(fourth, model.execute(fourth)).outputs)
    rest, _ = run_pipelined(sched, model)
    for rid, more in rest.items():
        tokens[rid] += more
    assert tokens == {"A": [7] * 4, "B": [7] * 4}
