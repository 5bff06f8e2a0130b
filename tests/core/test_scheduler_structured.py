"""Constrained requests in the scheduler: no model, no torch, a scripted grammar.

A constrained request waits (WAITING_FOR_FSM) until its compile future resolves while others
run; a failed or too-slow compile fails that request alone with an ERROR output; each sampled
token advances its matcher; the grammar's end finishes it; preemption keeps the matcher.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from pagedllm.engine.protocol import FinishReason
from pagedllm.request import RequestStatus
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import StructuredOutputGrammar
from pagedllm.structured_output.request import StructuredOutputRequest
from tests.core.test_scheduler import EOS, TOKEN, FakeModel, make_request, make_scheduler, run_to_completion, step  # noqa: F401


class ScriptGrammar(StructuredOutputGrammar):
    """Allows exactly ``script`` and then EOS (its end token)."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.accepted: list[int] = []

    def accept_token(self, token: int) -> bool:
        expected = self.script[len(self.accepted)] if len(self.accepted) < len(self.script) else EOS
        if token != expected or self.is_terminated():
            return False
        self.accepted.append(token)
        return True

    def fill_bitmask(self, bitmask, row: int) -> None:  # pragma: no cover - no bitmask without a model
        raise NotImplementedError

    def is_terminated(self) -> bool:
        return self.accepted[-1:] == [EOS] and len(self.accepted) == len(self.script) + 1


def constrained_request(req_id: str, prompt, future: cf.Future, timeout_s: float = 60.0, **sampling):
    request = make_request(req_id, prompt, **sampling, structured_outputs=StructuredOutputsParams(regex="x"))
    request.structured_output = StructuredOutputRequest(
        request.sampling_params.structured_outputs, future, lambda compiled: compiled, timeout_s
    )
    request.status = RequestStatus.WAITING_FOR_FSM
    return request


def test_waits_for_its_grammar_while_others_run(make_scheduler):
    scheduler = make_scheduler()
    future: cf.Future = cf.Future()
    grammar = ScriptGrammar([11, 12])
    model = FakeModel(scheduler, {"c": [11, 12, EOS]})
    scheduler.add_request(constrained_request("c", 20, future))
    scheduler.add_request(make_request("u", 20, max_tokens=5))
    assert scheduler.get_num_unfinished_requests() == 2
    for _ in range(2):  # not ready: only "u" runs
        out, _ = step(scheduler, model)
        assert list(out.num_scheduled_tokens) == ["u"] and out.structured_output_request_ids == []
        assert [r.request_id for r in scheduler.compiling] == ["c"]
    future.set_result(grammar)
    out, first = step(scheduler, model)
    assert list(out.num_scheduled_tokens) == ["u", "c"] and out.structured_output_request_ids == ["c"]
    outputs = run_to_completion(scheduler, model)
    tokens = [t for o in first.outputs if o.request_id == "c" for t in o.new_token_ids]
    assert tokens + [t for o in outputs["c"] for t in o.new_token_ids] == [11, 12, EOS]
    assert outputs["c"][-1].finish_reason == FinishReason.STOP
    assert grammar.accepted == [11, 12, EOS] and grammar.is_terminated()


def test_partial_prefill_chunks_get_no_bitmask_row(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=16)
    future: cf.Future = cf.Future()
    future.set_result(ScriptGrammar([]))
    scheduler.add_request(constrained_request("c", 40, future))
    model = FakeModel(scheduler, {"c": [EOS]})
    rows = [step(scheduler, model)[0].structured_output_request_ids for _ in range(3)]
    assert rows == [[], [], ["c"]]  # 16 + 16 + 8 prompt tokens; only the last chunk samples
    assert not scheduler.has_unfinished_requests()


def test_grammar_end_finishes_even_with_ignore_eos(make_scheduler):
    scheduler = make_scheduler()
    future: cf.Future = cf.Future()
    future.set_result(ScriptGrammar([11]))
    scheduler.add_request(constrained_request("c", 8, future, ignore_eos=True, max_tokens=50))
    outputs = run_to_completion(scheduler, FakeModel(scheduler, {"c": [11, EOS, 13]}))
    assert [t for o in outputs["c"] for t in o.new_token_ids] == [11, EOS]
    assert outputs["c"][-1].finish_reason == FinishReason.STOP


def test_a_token_the_grammar_rejects_fails_the_request(make_scheduler):
    # Only reachable when another constraint leaves the grammar nothing; never silently kept.
    scheduler = make_scheduler()
    future: cf.Future = cf.Future()
    future.set_result(ScriptGrammar([11, 12]))
    scheduler.add_request(constrained_request("c", 8, future))
    outputs = run_to_completion(scheduler, FakeModel(scheduler, {"c": [11, TOKEN]}))
    last = outputs["c"][-1]
    assert last.finish_reason == FinishReason.ERROR and str(last.finish_reason) == "error"
    assert "not allowed by the request's grammar" in last.stop_reason


@pytest.mark.parametrize("how", ["compile error", "deadline"])
def test_a_failed_compile_fails_only_that_request(make_scheduler, how):
    scheduler = make_scheduler()
    future: cf.Future = cf.Future()
    timeout = 0.0 if how == "deadline" else 60.0
    scheduler.add_request(constrained_request("bad", 8, future, timeout_s=timeout))
    scheduler.add_request(make_request("ok", 8, max_tokens=3))
    if how == "compile error":
        future.set_exception(ValueError('invalid JSON schema: Unsupported type "strnig"'))
    model = FakeModel(scheduler)
    out, outputs = step(scheduler, model)
    assert list(out.num_scheduled_tokens) == ["ok"]
    failed = [o for o in outputs.outputs if o.request_id == "bad"]
    assert len(failed) == 1 and failed[0].finish_reason == FinishReason.ERROR and failed[0].new_token_ids == []
    expected = "Unsupported type" if how == "compile error" else "did not compile within the time limit"
    assert expected in failed[0].stop_reason
    assert "bad" not in scheduler.requests and not scheduler.compiling
    run_to_completion(scheduler, model)


def test_abort_while_compiling(make_scheduler):
    scheduler = make_scheduler()
    scheduler.add_request(constrained_request("c", 8, cf.Future()))
    scheduler.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests() and not scheduler.compiling
    out, outputs = step(scheduler, FakeModel(scheduler))
    assert out.finished_req_ids == {"c"} and outputs.outputs == []


def test_preemption_keeps_the_matcher(make_scheduler):
    # 3 usable blocks of 16: two 14-token prompts fit, but both cannot grow past 16 tokens; the
    # later one is preempted and recomputed, and its grammar sees every output token exactly once.
    scheduler = make_scheduler(num_blocks=4)
    script = [20 + i for i in range(14)]
    grammars = {}
    for req_id in ("a", "b"):
        future: cf.Future = cf.Future()
        future.set_result(grammars.setdefault(req_id, ScriptGrammar(script)))
        scheduler.add_request(constrained_request(req_id, 14, future, max_tokens=30))
    outputs = run_to_completion(scheduler, FakeModel(scheduler, {"a": script + [EOS], "b": script + [EOS]}))
    assert scheduler.total_preemptions > 0
    for req_id in ("a", "b"):
        assert [t for o in outputs[req_id] for t in o.new_token_ids] == script + [EOS]
        assert grammars[req_id].accepted == script + [EOS]
        assert outputs[req_id][-1].finish_reason == FinishReason.STOP
