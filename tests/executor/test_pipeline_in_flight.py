"""Pipeline parallelism with a batch per stage in flight: while the last stage runs batch i, the
first runs batch i+1, which holds other requests; tokens stay those of one process (greedy,
float32); a request aborted while its batch runs frees its blocks once, after the batch is back;
``PAGEDLLM_PP_BATCHES_IN_FLIGHT=1`` makes the stages take turns."""

from __future__ import annotations

from typing import Any

import pytest

from executor.test_multiproc import ENGINE, _run
from pagedllm import LLM, SamplingParams
from pagedllm.engine.batch_queue import BatchQueue

# Prompts shorter than the step budget: no request is chunked, so batches in flight at once must
# hold disjoint requests (a prompt's next chunk may follow its previous one; a decode may not).
SHORT = [
    "hello world",
    "a b c d e f g",
    "the quick brown fox",
    "one two three four",
    "lorem ipsum dolor sit",
    "red green blue",
]
PARAMS = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[str] = SHORT) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(llama_model_dir) -> dict[str, list[int]]:
    llm = LLM(str(llama_model_dir), **ENGINE)
    outputs = llm.generate(SHORT, PARAMS, use_tqdm=False)
    for out in outputs:  # exact parity needs no near-ties at any position
        for position in out.outputs[0].logprobs or []:
            top = sorted((lp.logprob for lp in position.values()), reverse=True)
            assert top[0] - top[1] > 1e-4
    return {p: list(o.outputs[0].token_ids) for p, o in zip(SHORT, outputs)}


@pytest.fixture(scope="module")
def pp2(llama_model_dir):
    llm = LLM(str(llama_model_dir), pipeline_parallel_size=2, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def _spy(queue: BatchQueue) -> list[list[set[str]]]:
    """Record, at every submission, the requests of each batch then in flight."""
    seen: list[list[set[str]]] = []
    submit = queue.submit

    def spying(sched: Any) -> None:
        submit(sched)
        seen.append([set(s.num_scheduled_tokens) for s, _ in queue.steps])

    queue.submit = spying  # type: ignore[method-assign]
    return seen


def test_two_batches_of_other_requests_are_in_flight(pp2, reference) -> None:
    queue = pp2.llm_engine.engine_core.batch_queue
    assert isinstance(queue, BatchQueue) and queue.max_in_flight == 2
    seen = _spy(queue)
    assert _tokens(pp2) == [reference[p] for p in SHORT]
    # (An empty step goes too when the workers must see it: a finished request to drop.)
    pairs = [batches for batches in seen if len(batches) == 2 and all(batches)]
    assert len(pairs) >= 15  # 16 tokens of 6 requests in 2 batches: nearly every step overlaps
    for first, second in pairs:
        assert not first & second
    assert queue.peak == 2
    pp2.llm_engine.check_integrity()


def test_abort_in_flight_frees_blocks_once_after_the_batch(pp2, reference, monkeypatch) -> None:
    engine = pp2.llm_engine
    core = engine.engine_core
    manager = core.scheduler.kv_cache_manager
    frees: list[str] = []
    free = manager.free

    def counting(request: Any, *args: Any, **kwargs: Any) -> None:
        frees.append(request.request_id)
        free(request, *args, **kwargs)

    monkeypatch.setattr(manager, "free", counting)
    for i, prompt in enumerate(SHORT):
        engine.add_request(str(i), prompt, PARAMS)
    finished = {}
    for _ in range(100):
        # Between steps one batch is in flight (a step that fills the queue collects the oldest).
        if len(core.batch_queue) == 1 and core.scheduler.requests["0"].num_output_tokens:
            break
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    oldest = core.batch_queue.steps[0][0]
    victim = next(iter(oldest.num_scheduled_tokens))
    engine.abort_request([victim])
    assert victim in manager.req_to_blocks and victim not in frees  # its batch still writes them
    while any(s is oldest for s, _ in core.batch_queue.steps):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert frees.count(victim) == 1 and victim not in manager.req_to_blocks
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    engine.check_integrity()
    assert frees.count(victim) == 1 and victim not in finished
    assert {rid: list(o.outputs[0].token_ids) for rid, o in finished.items()} == {
        str(i): reference[p] for i, p in enumerate(SHORT) if str(i) != victim
    }


def test_one_batch_in_flight_when_asked(llama_model_dir, monkeypatch) -> None:
    reference = _run(LLM(str(llama_model_dir), **ENGINE), rounds=1)
    monkeypatch.setenv("PAGEDLLM_PP_BATCHES_IN_FLIGHT", "1")
    llm = LLM(str(llama_model_dir), pipeline_parallel_size=2, **ENGINE)
    try:
        assert llm.llm_engine.engine_core.batch_queue is None  # the stages take turns
        assert _run(llm, rounds=1) == reference
    finally:
        llm.llm_engine.shutdown()
    monkeypatch.setenv("PAGEDLLM_PP_BATCHES_IN_FLIGHT", "3")
    with pytest.raises(ValueError, match="from 1 to the pipeline's 2 stages"):
        LLM(str(llama_model_dir), pipeline_parallel_size=2, **ENGINE)
