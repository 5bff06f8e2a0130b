"""IterationStatsTracker: the front end's per-request timings from hand-made engine outputs.

TTFT and end-to-end latency use the front end's clock (``now``) from arrival; queue, prefill,
decode and inference times and inter-token latency use the engine core's event and step
timestamps, so every value here is exact.
"""

from __future__ import annotations

import pytest

from pagedllm.engine.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from pagedllm.metrics.stats import CompletedTiming, IterationStatsTracker, ScheduledTiming
from pagedllm.sampling_params import SamplingParams

QUEUED, SCHEDULED = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED


def request(request_id: str, prompt_len: int = 5, max_tokens: int | None = 8, arrival: float = 100.0):
    params = SamplingParams(max_tokens=max_tokens)
    return EngineCoreRequest(request_id, list(range(prompt_len)), params, None, arrival_time=arrival)


def output(request_id: str, num_tokens: int, events=(), finish: FinishReason | None = None, cached: int = 0):
    events = [EngineCoreEvent(kind, t) for kind, t in events] or None
    return EngineCoreOutput(request_id, [7] * num_tokens, finish_reason=finish, num_cached_tokens=cached, events=events)


def step(timestamp: float, *outs: EngineCoreOutput) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=list(outs), timestamp=timestamp)


def test_a_request_that_was_preempted_keeps_its_first_schedule():
    tracker = IterationStatsTracker()
    tracker.add_requests([request("a", prompt_len=6, max_tokens=4)])
    first = output("a", 1, [(QUEUED, 101.0), (SCHEDULED, 101.5)], cached=2)
    it = tracker.observe(step(102.0, first), now=102.25)
    assert it.time_to_first_tokens == [2.25] and it.num_prompt_tokens == 6 and it.num_cached_prompt_tokens == 2
    it = tracker.observe(step(102.5, output("a", 1)), now=102.6)
    assert it.inter_token_latencies == [0.5] and it.num_prompt_tokens == 0
    # Preempted and resumed: the new SCHEDULED comes with the next output and moves nothing.
    it = tracker.observe(step(104.5, output("a", 2, [(SCHEDULED, 103.0)], FinishReason.LENGTH)), now=105.0)
    assert it.inter_token_latencies == [1.0, 1.0]  # two tokens in one step (speculation): spread
    (done,) = it.finished_requests
    assert (done.finish_reason, done.e2e_latency, done.num_generation_tokens) == ("length", 5.0, 4)
    assert (done.num_prompt_tokens, done.num_cached_tokens, done.max_tokens_param) == (6, 2, 4)
    assert done.timing == CompletedTiming(
        queued_time=0.5, prefill_time=0.5, decode_time=2.5, inference_time=3.0, mean_time_per_output_token=2.5 / 3
    )
    assert it.n_params == [1] and it.max_num_generation_tokens == [4]


def test_parallel_sampling_reports_n_and_the_longest_child_once_all_finish():
    tracker = IterationStatsTracker()
    tracker.add_requests([request("p_0"), request("p_1"), request("p_2")])
    events = [(QUEUED, 100.5), (SCHEDULED, 100.6)]
    it = tracker.observe(
        step(101.0, output("p_0", 1, events), output("p_1", 1, events, FinishReason.STOP), output("p_2", 1, events)),
        now=101.0,
    )
    assert len(it.finished_requests) == 1 and it.n_params == [] and it.num_prompt_tokens == 15
    it = tracker.observe(step(102.0, output("p_0", 2, finish=FinishReason.LENGTH), output("p_2", 1)), now=102.0)
    assert it.n_params == []
    it = tracker.observe(step(103.0, output("p_2", 1, finish=FinishReason.STOP)), now=103.0)
    assert it.n_params == [3] and it.max_num_generation_tokens == [3]


def test_one_token_requests_have_no_time_per_output_token():
    tracker = IterationStatsTracker()
    tracker.add_requests([request("a")])
    it = tracker.observe(step(101.0, output("a", 1, [(QUEUED, 100.0), (SCHEDULED, 100.0)], FinishReason.STOP)), 101.0)
    timing = it.finished_requests[0].timing
    assert isinstance(timing, CompletedTiming) and timing.decode_time == 0 and timing.mean_time_per_output_token is None


@pytest.mark.parametrize(
    "outs, expected",
    [
        ([], None),  # aborted before the engine core said anything: never known to be scheduled
        ([output("a", 0, [(QUEUED, 100.0)])], None),  # e.g. its grammar failed while it waited
        ([output("a", 0, [(QUEUED, 100.0), (SCHEDULED, 100.25)])], ScheduledTiming(0.25)),  # no token yet
    ],
)
def test_aborted_requests_report_what_was_measured(outs, expected):
    tracker = IterationStatsTracker()
    tracker.add_requests([request("a")])
    if outs:
        tracker.observe(step(100.5, *outs), now=100.5)
    it = tracker.observe(step(101.0), now=101.0)
    tracker.finish("a", "abort", 102.0, it)
    (done,) = it.finished_requests
    assert done.timing == expected and done.num_generation_tokens == 0 and done.e2e_latency == 2.0
    assert it.n_params == [1] and it.max_num_generation_tokens == [0]
    tracker.finish("a", "abort", 103.0, it)  # finishing twice (abort racing a finish) counts once
    assert len(it.finished_requests) == 1
