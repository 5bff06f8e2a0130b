"""Engine-level sampling on a tiny random llama: seeds, top-k, n, stops, EOS, penalties, logprobs.

The sampling ops are checked by hand in tests/sampling; these tests prove the engine wires
every SamplingParams field through to the sampler and the output processor. One LLM serves
the module; after every test no request is left and the block pool is intact.
"""

from __future__ import annotations

import math
import random
import re

import pytest

from pagedllm import LLM, SamplingParams
from tests.engine_checks import assert_idle_and_intact

PROMPT = "The capital of France is"
LONG_PROMPT = "Once upon a time, in a village by the river, there lived an old clockmaker. " * 4


@pytest.fixture(scope="module")
def llm(llama_model_dir) -> LLM:
    # A small step budget so the longer prompts are chunked and a busy batch spans many steps.
    return LLM(str(llama_model_dir), max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture(autouse=True)
def _pool_intact(llm: LLM):
    yield
    assert_idle_and_intact(llm)


def _one(llm: LLM, prompt, params: SamplingParams):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def _greedy(llm: LLM, prompt=PROMPT, max_tokens: int = 32):
    return _one(llm, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def _num_repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


# ------------------------------------------------------------------ seeds, top-k, n
def _seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=24, ignore_eos=True)


def _busy_batch(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Ten other requests: different lengths, seeded differently, unseeded, greedy, penalised."""
    rng = random.Random(7)
    batch = []
    for i in range(10):
        prompt = [rng.randrange(6, vocab) for _ in range(rng.randint(2, 90))]
        params = SamplingParams(
            temperature=[0.0, 0.7, 1.0, 1.3][i % 4],
            top_p=[1.0, 0.8][i % 2],
            top_k=[0, 20, 0][i % 3],
            seed=[None, 99 + i][i % 2],
            max_tokens=rng.randint(4, 40),
            ignore_eos=True,
            repetition_penalty=1.3 if i == 3 else 1.0,
            frequency_penalty=0.5 if i == 5 else 0.0,
        )
        batch.append((prompt, params))
    return batch


def test_seeded_request_is_reproducible_alone_and_in_busy_batch(llm):
    alone = _one(llm, PROMPT, _seeded(1234)).token_ids
    assert len(alone) == 24
    assert _one(llm, PROMPT, _seeded(1234)).token_ids == alone
    others = _busy_batch(llm.llm_engine.config.model_config.arch.vocab_size)
    prompts = [{"prompt_token_ids": p} for p, _ in others]
    params = [sp for _, sp in others]
    prompts[4:4] = [PROMPT]  # in the middle of the batch, and once more at the end
    params[4:4] = [_seeded(1234)]
    prompts.append(PROMPT)
    params.append(_seeded(1234))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert outputs[4].outputs[0].token_ids == alone
    assert outputs[-1].outputs[0].token_ids == alone
    assert _one(llm, PROMPT, _seeded(1235)).token_ids != alone


def test_top_k_1_equals_greedy(llm):
    greedy = _greedy(llm)
    params = SamplingParams(temperature=1.0, top_k=1, max_tokens=32, ignore_eos=True)
    assert _one(llm, PROMPT, params).token_ids == greedy.token_ids


def test_n_samples_one_output_per_prompt(llm):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([PROMPT, "Hi"], params, use_tqdm=False)
    assert len(outputs) == 2
    for out in outputs:
        assert out.finished
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1


# ------------------------------------------------------------------ stop conditions
def _pick_stop_string(text: str) -> str:
    match = re.search(r"[A-Za-z]{3}", text[3:])
    assert match is not None, f"no ASCII word in the greedy text {text!r}"
    return match.group(0)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_from_greedy_text(llm, include):
    greedy = _greedy(llm)
    stop = _pick_stop_string(greedy.text)
    index = greedy.text.index(stop)
    params = SamplingParams(
        temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop], include_stop_str_in_output=include
    )
    out = _one(llm, PROMPT, params)
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == greedy.text[: index + (len(stop) if include else 0)]
    # Generation ended at the token that completed the stop string.
    assert out.token_ids == greedy.token_ids[: len(out.token_ids)]
    decode = llm.get_tokenizer().decode
    assert stop in decode(out.token_ids, skip_special_tokens=True)
    assert stop not in decode(out.token_ids[:-1], skip_special_tokens=True)


def test_stop_token_id_from_greedy_output(llm):
    greedy = _greedy(llm)
    stop_token = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_token)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop_token_ids=[stop_token])
    out = _one(llm, PROMPT, params)
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert greedy.text.startswith(out.text) and len(out.text) < len(greedy.text)


def _eos(llm: LLM) -> int:
    return llm.get_tokenizer().eos_token_id


def test_eos_finishes_with_no_stop_reason(llm):
    eos = _eos(llm)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=10, allowed_token_ids=[eos])
        out = _one(llm, PROMPT, params)
        assert (out.finish_reason, out.stop_reason, out.token_ids, out.text) == ("stop", None, [eos], "")


def test_min_tokens_holds_back_eos(llm):
    eos, filler = _eos(llm), 300
    # Only EOS and one filler token are allowed, and EOS dominates: EOS comes the moment it may.
    base = dict(temperature=0.0, max_tokens=10, allowed_token_ids=[eos, filler], logit_bias={eos: 100.0})
    assert _one(llm, PROMPT, SamplingParams(**base)).token_ids == [eos]
    out = _one(llm, PROMPT, SamplingParams(**base, min_tokens=5))
    assert out.token_ids == [filler] * 5 + [eos]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    ignored = _one(llm, PROMPT, SamplingParams(**base, ignore_eos=True))
    assert ignored.token_ids == [eos] * 10 and ignored.finish_reason == "length"


def test_max_tokens_finishes_with_length(llm):
    for max_tokens in (1, 7):
        out = _one(llm, PROMPT, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True))
        assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("length", None, max_tokens)


# ------------------------------------------------------------------ logit bias and penalties
def test_logit_bias_forces_token(llm):
    forced = 300
    outputs = llm.generate(
        [PROMPT, LONG_PROMPT],
        [
            SamplingParams(temperature=0.0, max_tokens=8, logit_bias={forced: 100.0}),
            SamplingParams(temperature=1.0, max_tokens=8, logit_bias={forced: 100.0}),
        ],
        use_tqdm=False,
    )
    for out in outputs:
        assert out.outputs[0].token_ids == [forced] * 8


@pytest.mark.parametrize(
    "penalty", [{"repetition_penalty": 2.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}]
)
def test_penalties_change_greedy_output(llm, penalty):
    plain = _greedy(llm).token_ids
    assert _num_repeats(plain) > 5  # the random model loops; penalties should break that
    out = _one(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, **penalty))
    assert out.token_ids != plain
    assert _num_repeats(out.token_ids) < _num_repeats(plain)


# ------------------------------------------------------------------ logprobs
def _check_positions(completion, k: int, greedy: bool) -> None:
    assert len(completion.logprobs) == len(completion.token_ids)
    for token, position in zip(completion.token_ids, completion.logprobs):
        assert token in position
        assert k <= len(position) <= k + 1
        _check_ranks(position, k)
        assert all(isinstance(lp.decoded_token, str) for lp in position.values())
        if greedy:
            assert position[token].rank == 1
    total = sum(position[t].logprob for t, position in zip(completion.token_ids, completion.logprobs))
    assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-4)


def _check_ranks(position: dict, k: int) -> None:
    """The top-k are ranked 1..k, best first; the chosen token has its own (any) rank."""
    ranked = sorted((lp.rank, lp.logprob) for lp in position.values())
    assert [rank for rank, _ in ranked if rank <= k] == list(range(1, k + 1))
    values = [value for _, value in ranked]
    assert values == sorted(values, reverse=True) and all(v <= 0.0 for v in values)


def test_sample_logprobs(llm):
    outputs = llm.generate(
        [PROMPT, LONG_PROMPT, "Hi"],
        [
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=1),  # fewer than the batch max
        ],
        use_tqdm=False,
    )
    _check_positions(outputs[0].outputs[0], 3, greedy=True)
    _check_positions(outputs[1].outputs[0], 3, greedy=False)
    _check_positions(outputs[2].outputs[0], 1, greedy=False)
    assert outputs[0].outputs[0].token_ids == _greedy(llm, max_tokens=12).token_ids


def test_prompt_logprobs(llm):
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode(LONG_PROMPT)
    assert len(prompt) > 64  # longer than the step budget: prompt logprobs arrive in chunks
    first = _one(llm, {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1, logprobs=0))
    # The prompt is in the prefix cache now; prompt logprobs must still cover every position.
    full = prompt + first.token_ids
    out = llm.generate({"prompt_token_ids": full}, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(full)
    for token, position in zip(full[1:], out.prompt_logprobs[1:]):
        assert token in position and 2 <= len(position) <= 3
        _check_ranks(position, 2)
    # The last prompt position saw exactly the context that produced the greedy token.
    last = out.prompt_logprobs[-1][first.token_ids[0]]
    assert last.rank == 1
    assert math.isclose(last.logprob, first.logprobs[0][first.token_ids[0]].logprob, abs_tol=1e-4)
