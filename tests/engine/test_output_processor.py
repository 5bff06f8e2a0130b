"""OutputProcessor end to end with hand-made EngineCoreOutputs (no engine core, no model)."""

from __future__ import annotations

import asyncio
import math

import pytest

from pagedllm.engine.logprobs import LogprobsProcessor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.engine.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
)
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

from .test_detokenizer import make_tokenizer

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def processor(tokenizer) -> OutputProcessor:
    return OutputProcessor(tokenizer, log_stats=True)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make_request(request_id: str, prompt_ids: list[int], **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt_ids, SamplingParams(**params), eos_token_id=1)


def out(request_id: str, tokens: list[int], finish: FinishReason | None = None, **kw):
    return EngineCoreOutput(request_id, tokens, finish_reason=finish, **kw)


def run(processor: OutputProcessor, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
    return processor.process_outputs(outputs).request_outputs


def fake_logprobs(tokens: list[int], width: int) -> LogprobsLists:
    """Rows whose top-k are tokens 10, 11, ...; the chosen token has rank 3, logprob -0.5."""
    ids = [[t] + [10 + j for j in range(width)] for t in tokens]
    lps = [[-0.5] + [-0.1 * (j + 1) for j in range(width)] for _ in tokens]
    return LogprobsLists(ids, lps, [3] * len(tokens))


# ---------------------------------------------------------------------------- finishing
def test_finish_by_length_and_metrics(processor, tokenizer) -> None:
    ids = encode(tokenizer, "hello world")
    processor.add_request(make_request("a", [0, 5, 6]), "prompt")
    first = run(processor, [out("a", ids[:1], num_cached_tokens=2)])
    assert first[0].outputs[0].text == tokenizer.decode(ids[:1])
    assert first[0].metrics.first_token_time is not None and not first[0].finished
    last = run(processor, [out("a", ids[1:], FinishReason.LENGTH)])[0]
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert last.outputs[0].text == "hello world" and last.outputs[0].token_ids == ids
    assert last.num_cached_tokens == 2 and last.prompt == "prompt"
    assert last.metrics.finished_time >= last.metrics.first_token_time
    assert last.metrics.time_to_first_token >= 0
    assert last.outputs[0].cumulative_logprob is None and last.outputs[0].logprobs is None
    assert not processor.has_unfinished_requests()


def test_eos_and_stop_token_finish(processor, tokenizer) -> None:
    ids = encode(tokenizer, "hi")
    processor.add_request(make_request("eos", [0], skip_special_tokens=False), None)
    processor.add_request(make_request("tok", [0], stop_token_ids=[ids[-1]]), None)
    outputs = run(
        processor,
        [
            out("eos", ids + [1], FinishReason.STOP),
            out("tok", ids, FinishReason.STOP, stop_reason=ids[-1]),
        ],
    )
    eos, tok = (o.outputs[0] for o in outputs)
    assert (eos.finish_reason, eos.stop_reason, eos.text) == ("stop", None, "hi")  # no "</s>"
    assert (tok.finish_reason, tok.stop_reason) == ("stop", ids[-1])
    assert tok.text == tokenizer.decode(ids[:-1])


def test_abort_from_core(processor) -> None:
    processor.add_request(make_request("x", [0]), None)
    [result] = run(processor, [out("x", [], FinishReason.ABORT)])
    assert result.finished and result.outputs[0].finish_reason == "abort"


def test_stop_string_finishes_and_asks_to_abort(processor, tokenizer) -> None:
    ids = encode(tokenizer, "hello world fox jumps")
    processor.add_request(make_request("s", [0], stop=["fox"]), None)
    result = processor.process_outputs([out("s", ids)])
    assert result.reqs_to_abort == ["s"]
    completion = result.request_outputs[0].outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == ("hello world ", "stop", "fox")
    assert completion.token_ids == ids  # tokens are not cut, like vLLM
    # The core still sends this step's leftovers: they are ignored.
    assert processor.process_outputs([out("s", [5])]).request_outputs == []


def test_stop_string_in_last_step_needs_no_abort(processor, tokenizer) -> None:
    processor.add_request(make_request("s", [0], stop=["fox"]), None)
    result = processor.process_outputs([out("s", encode(tokenizer, "a fox"), FinishReason.LENGTH)])
    assert result.reqs_to_abort == []
    assert result.request_outputs[0].outputs[0].finish_reason == "stop"


# ---------------------------------------------------------------------------- output kinds
def _stream(processor, tokenizer, kind: RequestOutputKind, **params) -> list[RequestOutput]:
    ids = encode(tokenizer, "the quick 😀 brown fox")
    processor.add_request(make_request("k", [0], output_kind=kind, **params), None)
    results = []
    for i, token_id in enumerate(ids):
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        results += run(processor, [out("k", [token_id], finish)])
    return results


def test_output_kinds(processor, tokenizer) -> None:
    text = "the quick 😀 brown fox"
    cumulative = _stream(processor, tokenizer, CUMULATIVE, stop=["zz"])
    delta = _stream(processor, tokenizer, DELTA, stop=["zz"])
    final = _stream(processor, tokenizer, FINAL_ONLY)
    assert len(cumulative) == len(delta) == len(encode(tokenizer, text))
    assert cumulative[-1].outputs[0].text == text
    texts = [r.outputs[0].text for r in cumulative]
    assert all(a == b[: len(a)] for a, b in zip(texts, texts[1:]))  # only ever grows
    assert "".join(r.outputs[0].text for r in delta) == text
    assert sum((r.outputs[0].token_ids for r in delta), []) == encode(tokenizer, text)
    assert all(len(r.outputs[0].token_ids) == 1 for r in delta)
    assert [r.finished for r in delta][-2:] == [False, True]
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].text == text


# ---------------------------------------------------------------------------- logprobs
def test_sample_logprobs_shapes_ranks_cumulative(processor, tokenizer) -> None:
    processor.add_request(make_request("l", [0], logprobs=2), None)
    # The batch asked for 4 top columns; this request only wants 2.
    run(processor, [out("l", [50], new_logprobs=fake_logprobs([50], 4))])
    lists = LogprobsLists([[11, 10, 11, 12, 13]], [[-0.2, -0.1, -0.2, -0.3, -0.4]], [2])
    [result] = run(processor, [out("l", [11], FinishReason.LENGTH, new_logprobs=lists)])
    completion = result.outputs[0]
    first, second = completion.logprobs
    assert list(first) == [50, 10, 11]
    assert first[50] == Logprob(-0.5, 3, tokenizer.decode([50]))
    assert (first[10].rank, first[11].rank) == (1, 2)
    assert list(second) == [11, 10]  # the chosen token is also in the top-k: listed once
    assert second[11].rank == 2
    assert math.isclose(completion.cumulative_logprob, -0.7)


def test_logprobs_zero_keeps_only_the_chosen_token() -> None:
    processor = LogprobsProcessor(SamplingParams(logprobs=0), decode=lambda t: f"<{t}>")
    processor.update_from_output(fake_logprobs([7, 8], 3), None)
    assert processor.logprobs == [{7: Logprob(-0.5, 3, "<7>")}, {8: Logprob(-0.5, 3, "<8>")}]
    assert math.isclose(processor.cumulative_logprob, -1.0)


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_prompt_logprobs_over_two_chunks(processor, tokenizer, kind) -> None:
    prompt = encode(tokenizer, "the quick brown fox")
    processor.add_request(make_request("p", prompt, prompt_logprobs=1, output_kind=kind), None)
    half = len(prompt) // 2
    chunk1 = fake_logprobs(prompt[1:half], 2)
    chunk2 = fake_logprobs(prompt[half:], 2)
    assert run(processor, [out("p", [], new_prompt_logprobs=chunk1)]) == []
    first = run(processor, [out("p", [5], new_prompt_logprobs=chunk2)])[0]
    second = run(processor, [out("p", [6], FinishReason.LENGTH)])[0]
    plp = first.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    assert [next(iter(d)) for d in plp[1:]] == prompt[1:]  # the actual prompt tokens first
    assert all(len(d) == 2 and 10 in d for d in plp[1:])
    assert second.prompt_logprobs == (plp if kind == CUMULATIVE else None)


# ---------------------------------------------------------------------------- n > 1
def _add_parent(processor, kind: RequestOutputKind, queue=None) -> ParentRequest:
    request = make_request("p", [0, 5], n=3, output_kind=kind, seed=7)
    parent = ParentRequest("p", 3, kind, "prompt", request.prompt_token_ids)
    for index in range(3):
        child = ParentRequest.child_request(request, index)
        assert child.request_id == f"{index}_p" and child.sampling_params.seed == 7 + index
        processor.add_request(child, "prompt", parent=parent, index=index, queue=queue)
    return parent


def test_parent_cumulative_aggregates_children(processor, tokenizer) -> None:
    _add_parent(processor, CUMULATIVE)
    a, b = encode(tokenizer, "hello"), encode(tokenizer, "world")
    step1 = run(processor, [out("0_p", a), out("2_p", b, FinishReason.LENGTH)])
    assert len(step1) == 1 and step1[0].request_id == "p" and not step1[0].finished
    assert [c.index for c in step1[0].outputs] == [0, 2]
    step2 = run(processor, [out("1_p", b, FinishReason.LENGTH), out("0_p", b, FinishReason.LENGTH)])
    assert len(step2) == 1 and step2[0].finished
    assert [c.text for c in step2[0].outputs] == ["helloworld", "world", "world"]
    assert not processor.has_unfinished_requests() and not processor.parents


def test_parent_final_only_emits_once(processor, tokenizer) -> None:
    _add_parent(processor, FINAL_ONLY)
    ids = encode(tokenizer, "fox")
    assert run(processor, [out("0_p", ids, FinishReason.LENGTH), out("1_p", ids)]) == []
    assert run(processor, [out("2_p", ids, FinishReason.LENGTH)]) == []
    [final] = run(processor, [out("1_p", ids, FinishReason.LENGTH)])
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.text for c in final.outputs] == ["fox", "foxfox", "fox"]


def test_parent_delta_streams_each_child(processor, tokenizer) -> None:
    _add_parent(processor, DELTA)
    ids = encode(tokenizer, "fox")
    step = run(processor, [out("0_p", ids), out("1_p", ids, FinishReason.LENGTH)])
    assert [(r.request_id, r.outputs[0].index, r.finished) for r in step] == [("p", 0, False), ("p", 1, False)]
    done = FinishReason.LENGTH
    step = run(processor, [out("2_p", ids, done), out("0_p", ids, done)])
    assert [r.finished for r in step] == [False, True]
    assert step[1].outputs[0].text == "fox"  # only the new text


def test_fan_out_is_the_one_n_gt_1_path(processor, tokenizer) -> None:
    """What LLMEngine and AsyncLLM both send to the core: n children under one parent, or the
    request itself for n == 1."""
    single = make_request("s", [0, 5])
    assert processor.fan_out(single, "prompt") == [single]
    assert not processor.parents and "s" in processor.request_states
    queue: asyncio.Queue = asyncio.Queue()
    children = processor.fan_out(make_request("p", [0, 5], n=3, seed=7, output_kind=FINAL_ONLY), "prompt", queue)
    assert [c.request_id for c in children] == ["0_p", "1_p", "2_p"]
    assert [(c.sampling_params.n, c.sampling_params.seed) for c in children] == [(1, 7), (1, 8), (1, 9)]
    parent = processor.parents["p"]
    assert parent.n == 3 and parent.running == {"0_p", "1_p", "2_p"} and parent.queue is queue
    ids = encode(tokenizer, "fox")
    run(processor, [out(c.request_id, ids, FinishReason.LENGTH) for c in children])
    final = queue.get_nowait()
    assert final.request_id == "p" and final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert processor.abort_requests(["s"]) == ["s"] and not processor.has_unfinished_requests()


# ---------------------------------------------------------------------------- delivery, abort
def test_queue_delivery(processor, tokenizer) -> None:
    queue: asyncio.Queue = asyncio.Queue()
    processor.add_request(make_request("q", [0]), None, queue=queue)
    processor.add_request(make_request("r", [0]), None)
    _add_parent(processor, FINAL_ONLY, queue=queue)
    ids = encode(tokenizer, "hi")
    outputs = [out("q", ids, FinishReason.LENGTH), out("r", ids)]
    outputs += [out(f"{i}_p", ids, FinishReason.LENGTH) for i in range(3)]
    returned = run(processor, outputs)
    assert [r.request_id for r in returned] == ["r"]
    queued = [queue.get_nowait().request_id for _ in range(queue.qsize())]
    assert queued == ["q", "p"]


def test_abort_requests(processor, tokenizer) -> None:
    processor.add_request(make_request("a", [0]), None)
    processor.add_request(make_request("b", [0]), None)
    _add_parent(processor, CUMULATIVE)
    run(processor, [out("1_p", encode(tokenizer, "x"), FinishReason.LENGTH)])
    assert processor.get_num_unfinished_requests() == 4
    aborted = processor.abort_requests(["a", "p", "unknown"])
    assert sorted(aborted) == ["0_p", "2_p", "a"]
    assert processor.get_num_unfinished_requests() == 1 and not processor.parents
    assert run(processor, [out("a", [5]), out("0_p", [5])]) == []
    with pytest.raises(ValueError, match="already running"):
        processor.add_request(make_request("b", [0]), None)


def test_detokenize_false_and_readable_repr(processor) -> None:
    processor.add_request(make_request("d", list(range(30)), detokenize=False, logprobs=1), None)
    [result] = run(processor, [out("d", [5, 6], FinishReason.LENGTH, new_logprobs=fake_logprobs([5, 6], 1))])
    assert result.outputs[0].text == "" and result.outputs[0].token_ids == [5, 6]
    assert result.outputs[0].logprobs[0][5].decoded_token is None
    text = repr(result)
    assert text.startswith("RequestOutput(request_id='d'") and "(30 total)" in text
    assert "finish_reason='length'" in text
