"""What the scheduler reports for the metrics (no model, no torch): the queued and scheduled
events that ride on each request's next output, the waiting queue split by reason, and the
tokens each step computed."""

from __future__ import annotations

import concurrent.futures as cf

from pagedllm.engine.protocol import EngineCoreEventType, EngineCoreOutputs
from pagedllm.request import RequestStatus
from tests.core.test_scheduler import FakeModel, make_request, make_scheduler, run_to_completion, step  # noqa: F401
from tests.core.test_scheduler_structured import constrained_request

QUEUED, SCHEDULED = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED


def events_of(outputs: EngineCoreOutputs) -> dict[str, list[EngineCoreEventType]]:
    return {o.request_id: [e.type for e in o.events or []] for o in outputs.outputs}


def test_events_ride_on_the_next_output_and_resumes_are_scheduled_again(make_scheduler):
    # 6 usable blocks of 16: A and B (32-token prompts) fit, but not once both grow.
    scheduler = make_scheduler(num_blocks=7)
    model = FakeModel(scheduler)
    scheduler.add_request(make_request("A", 32, max_tokens=20, ignore_eos=True))
    scheduler.add_request(make_request("B", 32, max_tokens=20, ignore_eos=True))
    out, outputs = step(scheduler, model)
    assert events_of(outputs) == {"A": [QUEUED, SCHEDULED], "B": [QUEUED, SCHEDULED]}
    first = {o.request_id: [e.timestamp for e in o.events or []] for o in outputs.outputs}
    assert first["A"][0] <= first["A"][1] <= outputs.timestamp
    assert outputs.scheduler_stats.num_scheduled_tokens == out.total_num_scheduled_tokens == 64
    out, outputs = step(scheduler, model)
    assert events_of(outputs) == {"A": [], "B": []}  # sent once
    assert outputs.scheduler_stats.num_scheduled_tokens == 2
    resumed: list[str] = []
    while scheduler.has_unfinished_requests():
        out, outputs = step(scheduler, model)
        resumed += [rid for rid, kinds in events_of(outputs).items() if kinds == [SCHEDULED]]
    assert scheduler.total_preemptions >= 1 and resumed == ["B"] * scheduler.total_preemptions
    assert scheduler.events._pending == {}


def test_waiting_for_a_grammar_is_deferred_not_capacity(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=1)
    future: cf.Future = cf.Future()
    scheduler.add_request(constrained_request("c", 20, future))
    scheduler.add_request(make_request("u", 20, max_tokens=3))
    scheduler.add_request(make_request("v", 20, max_tokens=3))
    model = FakeModel(scheduler)
    _, outputs = step(scheduler, model)
    stats = outputs.scheduler_stats
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_deferred_reqs) == (1, 2, 1)
    scheduler.finish_requests(["c", "v"], RequestStatus.FINISHED_ABORTED)  # their events are dropped
    run_to_completion(scheduler, model)
    assert scheduler.events._pending == {}
    idle = scheduler.make_stats()
    assert (idle.num_waiting_reqs, idle.num_deferred_reqs, idle.num_scheduled_tokens) == (0, 0, 0)
