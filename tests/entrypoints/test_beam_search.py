"""Beam search (``LLM.beam_search`` and ``SamplingParams(use_beam_search=True)``) against
transformers' ``generate(num_beams=k)``, its rule on hand-made logprobs, and its KV sharing.

What equals HF token for token, and why the rest differs (docs/architecture.md, "Beam search"):

* ``ignore_eos=True`` (HF: no EOS): every final beam has the same length, so length
  normalisation cannot reorder them; any ``length_penalty`` and any ``early_stopping`` agree.
* EOS live, ``length_penalty=0`` (raw cumulative logprob, so "length including the prompt"
  (vLLM) and "generated length including EOS" (HF) cannot disagree), ``early_stopping="never"``:
  equal, except that vLLM's rule keeps every EOS candidate of each beam's top ``2k`` while HF
  finalises an EOS candidate only when it ranks in the step's top ``k`` over all beams. Those
  extra hypotheses are the only differences, and each outranks the HF beam it displaces.
* EOS live with ``length_penalty != 0``: the normalising lengths differ, so rankings differ.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.beam_search import BeamSearchInstance, get_beam_search_score
from pagedllm.outputs import Logprob
from tests.engine_checks import assert_idle_and_intact

TEXTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Once upon a time, in a land far, far away",
    "1 2 3 4 5 6 7 8",
    "The quick brown fox jumps over the lazy dog.",
]
NEW_TOKENS = 10
EOS = 1  # the tiny tokenizer's eos_token_id (the generation config also lists <|im_end|>)


# ------------------------------------------------------------------ the rule, no model


def _row(*pairs: tuple[int, float]) -> dict[int, Logprob]:
    return {tok: Logprob(lp, rank=i + 1) for i, (tok, lp) in enumerate(pairs)}


def test_score_counts_the_prompt_and_drops_a_final_eos() -> None:
    assert get_beam_search_score([5, 6, 7, 8], -2.0, EOS, 1.0) == -0.5
    assert get_beam_search_score([5, 6, 7, EOS], -3.0, EOS, 1.0) == -1.0
    assert get_beam_search_score([5, 6, 7, 8], -2.0, EOS, 0.0) == -2.0
    assert get_beam_search_score([5, 6, 7, 8], -2.0, EOS, 2.0) == -2.0 / 16


def test_expand_and_prune_keep_width_best_and_complete_eos() -> None:
    inst = BeamSearchInstance([9, 9], BeamSearchParams(beam_width=2, max_tokens=3), EOS)
    (root,) = inst.beams
    inst.expand(root, _row((EOS, -0.125), (3, -0.5), (4, -0.75), (5, -2.0)))
    inst.prune()
    assert [b.output_token_ids for b in inst.beams] == [[3], [4]]
    assert [(c.output_token_ids, c.finish_reason, c.stop_reason) for c in inst.completed] == [([EOS], "stop", EOS)]
    a, b = inst.beams
    inst.expand(a, _row((6, -3.0), (EOS, -4.0)))
    inst.expand(b, _row((7, -0.125), (8, -0.25)))
    inst.prune()
    assert [(x.output_token_ids, x.cum_logprob) for x in inst.beams] == [([4, 7], -0.875), ([4, 8], -1.0)]
    assert len(inst.completed) == 2  # [3, EOS] joined although no live slot was at stake
    best = inst.best()  # completed and live together, by score
    assert [x.output_token_ids for x in best] == [[EOS], [4, 7]]
    assert [x.finish_reason for x in best] == ["stop", "length"]


def test_ignore_eos_keeps_eos_beams_live() -> None:
    inst = BeamSearchInstance([9], BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True), EOS)
    inst.expand(inst.beams[0], _row((EOS, -0.1), (3, -0.5)))
    inst.prune()
    assert [b.output_token_ids for b in inst.beams] == [[EOS], [3]] and not inst.completed


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": True}, "beam_width"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"length_penalty": float("inf")}, "length_penalty"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ],
)
def test_params_validation_names_the_field(kwargs, field) -> None:
    args = {"beam_width": 2, "max_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**args)


def test_beam_search_module_is_torch_free() -> None:
    script = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        sys.modules["numpy"] = None
        import pagedllm.beam_search
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


# ------------------------------------------------------------------ against transformers


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tiny_model_dir):
    """(LLM, HF model, prompts as token ids) for one architecture."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_model_dir(request.param)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token_id == EOS
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32")
    yield llm, hf, [tokenizer.encode(t) for t in TEXTS]
    assert_idle_and_intact(llm)


def _hf_beams(hf, prompt: list[int], width: int, length_penalty: float, eos: int | None, early_stopping="never"):
    """HF's ``num_return_sequences=width`` sequences (generated part, cut after EOS) and scores."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=eos,
        pad_token_id=2,
        bos_token_id=0,
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            output_scores=True,
            return_dict_in_generate=True,
        )
    rows = [row[len(prompt) :] for row in out.sequences.tolist()]
    rows = [row[: row.index(eos) + 1] if eos in row else row for row in rows]
    return rows, out.sequences_scores.tolist()


def _ours(llm, prompts, width, length_penalty, ignore_eos):
    params = BeamSearchParams(
        beam_width=width, max_tokens=NEW_TOKENS, length_penalty=length_penalty, ignore_eos=ignore_eos
    )
    return llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (4, 1.0), (2, 2.0), (4, 0.5)])
def test_equals_hf_without_eos(case, width, length_penalty) -> None:
    llm, hf, prompts = case
    for prompt, result in zip(prompts, _ours(llm, prompts, width, length_penalty, ignore_eos=True)):
        ref, ref_scores = _hf_beams(hf, prompt, width, length_penalty, eos=None)
        assert [s.output_token_ids for s in result.sequences] == ref
        for seq, score in zip(result.sequences, ref_scores):
            # HF's score is cum_logprob / generated_len ** length_penalty.
            assert math.isclose(seq.cum_logprob / NEW_TOKENS**length_penalty, score, abs_tol=1e-4)
            assert seq.finish_reason == "length" and seq.tokens == prompt + seq.output_token_ids
    assert_idle_and_intact(llm)


@pytest.mark.parametrize("width", [2, 4])
def test_equals_hf_with_eos_at_zero_length_penalty_but_for_extra_eos_hypotheses(case, width) -> None:
    llm, hf, prompts = case
    num_equal = num_eos = 0
    for prompt, result in zip(prompts, _ours(llm, prompts, width, 0.0, ignore_eos=False)):
        ref, ref_scores = _hf_beams(hf, prompt, width, 0.0, eos=EOS)
        ours = [s.output_token_ids for s in result.sequences]
        num_eos += sum(s.finish_reason == "stop" for s in result.sequences)
        if ours == ref:
            num_equal += 1
            continue
        # Every difference is an EOS hypothesis HF never finalised, scoring above what it displaced.
        extra = [s for s in result.sequences if s.output_token_ids not in ref]
        assert extra and all(s.finish_reason == "stop" and s.output_token_ids[-1] == EOS for s in extra)
        displaced = [score for row, score in zip(ref, ref_scores) if row not in ours]
        assert min(s.cum_logprob for s in extra) > max(displaced) - 1e-4
        kept = [row for row in ours if row in ref]
        assert kept == [row for row in ref if row in ours]  # the shared beams in the same order
    assert num_equal >= len(prompts) - 2, "most prompts agree exactly"
    if width == 4 and hf.config.model_type == "llama":
        assert num_eos > 0, "the comparison should exercise EOS-ended beams"
    assert_idle_and_intact(llm)


def test_results_are_ranked_by_vllm_score(case) -> None:
    """With EOS live and length_penalty=1 the order follows cum_logprob / (prompt + output
    length, less a final EOS) -- vLLM's score, not HF's (generated length incl. EOS)."""
    llm, _, prompts = case
    for result in _ours(llm, prompts, 4, 1.0, ignore_eos=False):
        scores = [get_beam_search_score(s.tokens, s.cum_logprob, EOS, 1.0) for s in result.sequences]
        assert scores == sorted(scores, reverse=True) and len(scores) == 4
    assert_idle_and_intact(llm)


def test_text_is_the_generated_part_and_eos_shows_only_when_asked(case) -> None:
    llm, _, prompts = case
    tokenizer = llm.get_tokenizer()
    for include in (False, True):
        params = BeamSearchParams(beam_width=4, max_tokens=NEW_TOKENS, include_stop_str_in_output=include)
        for result in llm.beam_search([{"prompt_token_ids": p} for p in prompts], params):
            for seq in result.sequences:
                stopped = seq.finish_reason == "stop"
                body = tokenizer.decode(seq.output_token_ids[: -1 if stopped else None], skip_special_tokens=True)
                assert seq.text == body + (tokenizer.eos_token if stopped and include else "")
    assert_idle_and_intact(llm)


# ------------------------------------------------------------------ the SamplingParams route


def test_use_beam_search_in_generate_returns_top_n_beams(case) -> None:
    llm, _, prompts = case
    params = SamplingParams(use_beam_search=True, best_of=4, n=2, length_penalty=0.5, max_tokens=NEW_TOKENS, logprobs=1)
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    batch = [{"prompt_token_ids": prompts[1]}, {"prompt_token_ids": prompts[2]}, {"prompt_token_ids": prompts[3]}]
    outputs = llm.generate(batch, [params, plain, params], use_tqdm=False)
    searched = _ours(llm, [prompts[1], prompts[3]], 4, 0.5, ignore_eos=False)
    for out, result in zip([outputs[0], outputs[2]], searched):
        assert out.finished and out.prompt_token_ids == result.sequences[0].tokens[: len(out.prompt_token_ids)]
        assert [c.token_ids for c in out.outputs] == [s.output_token_ids for s in result.sequences[:2]]
        for c, s in zip(out.outputs, result.sequences):
            assert c.cumulative_logprob == s.cum_logprob and c.finish_reason == s.finish_reason
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            for row, token in zip(c.logprobs, c.token_ids):
                assert token in row and all(lp.rank is not None and lp.rank <= 1 for t, lp in row.items() if t != token)
            text_ids = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
            assert c.text == llm.get_tokenizer().decode(text_ids, skip_special_tokens=True)
    assert len(outputs[1].outputs) == 1 and len(outputs[1].outputs[0].token_ids) == 3
    assert_idle_and_intact(llm)


def test_beam_width_over_the_logprobs_cap_is_refused(case) -> None:
    llm, _, prompts = case
    with pytest.raises(ValueError, match="beam_width=11"):
        llm.beam_search([prompts[0]], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="beam_width=11"):
        llm.generate([prompts[0]], SamplingParams(use_beam_search=True, best_of=11, max_tokens=2), use_tqdm=False)
    assert_idle_and_intact(llm)


# ------------------------------------------------------------------ limits and KV sharing


def test_beams_stop_at_max_model_len(llama_model_dir) -> None:
    llm = LLM(str(llama_model_dir), dtype="float32", max_model_len=20)
    prompt = llm.get_tokenizer().encode("Once upon a time, in a land")
    result = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True))[0]
    for seq in result.sequences:
        assert len(seq.tokens) == 20 and seq.finish_reason == "length"
    assert_idle_and_intact(llm)


def _record_block_use(llm) -> list[dict]:
    """After every schedule(): the used-block count, each request's block ids, tokens and
    scheduled (computed this step) token count."""
    scheduler = llm.llm_engine.engine_core.scheduler
    kv = scheduler.kv_cache_manager
    original = scheduler.schedule
    log: list[dict] = []

    def schedule():
        out = original()
        used = sum(1 for b in kv.block_pool.blocks[1:] if b.ref_cnt > 0)
        reqs = {
            rid: (kv.get_block_ids(rid), list(scheduler.requests[rid].all_token_ids), n)
            for rid, n in out.num_scheduled_tokens.items()
        }
        log.append({"used": used, "reqs": reqs})
        return out

    scheduler.schedule = schedule
    return log


@pytest.mark.parametrize("max_tokens", [8, 24])
def test_beams_share_full_blocks_and_copy_their_partial_tail(llama_model_dir, max_tokens) -> None:
    """k beams over a long prompt hold the prompt's full blocks once plus one tail each; a beam
    copies its parent's partial last block (copy-on-write) and computes one token per step."""
    llm = LLM(str(llama_model_dir), dtype="float32", block_size=16)
    prompt = (llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog. " * 20))[:83]
    width, block = 4, 16
    log = _record_block_use(llm)
    llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    assert len(log) == max_tokens and len(log[0]["reqs"]) == 1 and log[0]["used"] == 6  # 83 tokens
    for step in log[1:]:
        tables = [ids for ids, _, _ in step["reqs"].values()]
        assert len(tables) == width
        assert all(t[:5] == tables[0][:5] for t in tables), "the 5 full prompt blocks are shared"
        for _, _, computed in step["reqs"].values():
            assert computed == 1  # the parent's full blocks are shared, its partial block copied
        full_prefixes = {
            tuple(tok[: block * (j + 1)]) for _, tok, _ in step["reqs"].values() for j in range(len(tok) // block)
        }
        tails = sum(1 for _, tok, _ in step["reqs"].values() if len(tok) % block)
        assert step["used"] == len(full_prefixes) + tails  # shared full blocks once, plus the tails
    if max_tokens == 8:
        assert [s["used"] for s in log] == [6] + [5 + width] * 7  # vs 6 * width = 24 without sharing
    assert_idle_and_intact(llm)
