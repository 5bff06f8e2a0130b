"""Fair share: the waiting queue serves tenants (API keys) in turn, each in its policy's order.
Exact orders, no model, no torch."""

from __future__ import annotations

import pytest

from pagedllm.core.request_queue import FairShareQueue, FCFSQueue
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import FakeModel, MakeScheduler, make_scheduler, run_to_completion, step

__all__ = ["make_scheduler"]  # the fixture, shared with test_scheduler


def req(request_id: str, tenant: str | None, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(
        request_id, [1, 2, 3], SamplingParams(max_tokens=2), 2, arrival_time=arrival, priority=priority, tenant=tenant
    )


def drain(queue: FairShareQueue) -> list[str]:
    order = []
    while len(queue):
        assert queue.peek() is queue.peek()
        order.append(queue.pop().request_id)
    return order


def test_tenants_take_turns_each_in_fcfs_order() -> None:
    queue = FairShareQueue("fcfs")
    for i in range(4):
        queue.add(req(f"a{i}", "A"))
    queue.add(req("b0", "B"))
    queue.add(req("b1", "B"))
    queue.add(req("c0", "C"))
    assert len(queue) == 7
    assert drain(queue) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


def test_a_late_tenant_is_served_next_not_after_the_flood() -> None:
    queue = FairShareQueue("fcfs")
    for i in range(1000):
        queue.add(req(f"a{i}", "A"))
    assert [queue.pop().request_id for _ in range(3)] == ["a0", "a1", "a2"]
    queue.add(req("b0", "B"))  # B was never served: it goes before A's 997 others
    assert [queue.pop().request_id for _ in range(3)] == ["b0", "a3", "a4"]


def test_one_tenant_is_plain_fcfs_with_preempted_in_front() -> None:
    queue = FairShareQueue("fcfs")
    for name in ("x", "y", "z"):
        queue.add(req(name, None))
    preempted = queue.pop()
    preempted.status = RequestStatus.PREEMPTED
    queue.prepend(preempted)
    assert [r.request_id for r in queue] == ["x", "y", "z"] and drain(queue) == ["x", "y", "z"]


def test_a_preempted_request_goes_before_other_tenants() -> None:
    queue = FairShareQueue("fcfs")
    queue.add(req("a0", "A"))
    queue.add(req("b0", "B"))
    running = queue.pop()  # a0; B is next in turn
    running.status = RequestStatus.PREEMPTED
    queue.prepend(running)
    assert drain(queue) == ["a0", "b0"]


def test_priority_first_then_turns_among_equals() -> None:
    queue = FairShareQueue("priority")
    queue.add(req("a-low", "A", priority=5, arrival=0))
    queue.add(req("a-high", "A", priority=0, arrival=1))
    queue.add(req("a-high2", "A", priority=0, arrival=2))
    queue.add(req("b-high", "B", priority=0, arrival=3))
    queue.add(req("b-low", "B", priority=5, arrival=4))
    # The lows tie on priority: B, served longer ago than A, goes first.
    assert drain(queue) == ["a-high", "b-high", "a-high2", "b-low", "a-low"]


def test_remove_and_an_emptied_tenant_keeps_its_turn() -> None:
    queue = FairShareQueue("fcfs")
    a0, a1, b0 = req("a0", "A"), req("a1", "A"), req("b0", "B")
    for r in (a0, a1, b0):
        queue.add(r)
    queue.remove(a1)
    assert queue.pop() is a0  # A's queue is empty now, but it was served last
    queue.add(req("a2", "A"))
    assert drain(queue) == ["b0", "a2"]
    with pytest.raises(IndexError):
        queue.peek()


def test_scheduler_gives_a_freed_slot_to_the_other_tenant(make_scheduler: MakeScheduler) -> None:
    """Tenant A fills the batch and queues 20 more; B's one request takes the first freed slot."""
    sched = make_scheduler(num_blocks=40, max_num_seqs=2)
    model = FakeModel(sched)
    for i in range(22):
        sched.add_request(req(f"a{i}", "A"))
    out, _ = step(sched, model)
    assert sorted(out.num_scheduled_tokens) == ["a0", "a1"]
    sched.add_request(req("b0", "B"))
    out, outputs = step(sched, model)  # a0 and a1 finish (max_tokens 2)
    assert sorted(out.num_scheduled_tokens) == ["a0", "a1"] and all(o.finished for o in outputs.outputs)
    out, _ = step(sched, model)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b0", "a2"]
    run_to_completion(sched, model)


def test_without_fair_share_the_late_tenant_waits_behind_the_flood(make_scheduler: MakeScheduler) -> None:
    """The same flood with one plain FCFS queue (the order before fair share): B's request is
    admitted only after all of A's."""
    sched = make_scheduler(num_blocks=40, max_num_seqs=2)
    sched.waiting = FCFSQueue()
    model = FakeModel(sched)
    for i in range(22):
        sched.add_request(req(f"a{i}", "A"))
    step(sched, model)
    sched.add_request(req("b0", "B"))
    admitted: list[str] = []
    while "b0" not in admitted:
        out, _ = step(sched, model)
        admitted += [r.req_id for r in out.scheduled_new_reqs]
    assert admitted == [f"a{i}" for i in range(2, 22)] + ["b0"]
    run_to_completion(sched, model)
