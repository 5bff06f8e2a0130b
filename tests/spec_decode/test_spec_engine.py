"""Speculative decoding end to end: output is unchanged, only produced in fewer steps.

Greedy output with n-gram and draft-model proposals must equal the same engine without
speculation, token for token, on several architectures, with chunked prefill, preemption and
prefix caching in the same batch; sampled output must follow the same distribution.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _prompts() -> list[list[int]]:
    """Repetitive and plain prompts; the first two share a 48-token prefix (prefix-cache hits)."""
    shared = [11 + (i % 7) for i in range(48)]
    return [
        shared + [30, 31],
        shared + [40, 41, 42],
        list(range(20, 90)),
        [5, 6, 7, 8] * 6,
        [100 + i for i in range(9)],
        [3, 4] * 20,
    ]


def _generate(model_dir, params=GREEDY, prompts=None, **engine_kwargs):
    engine_kwargs.setdefault("max_model_len", 256)
    llm = LLM(str(model_dir), max_num_seqs=8, **engine_kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts or _prompts()], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.check_integrity()
    return llm, outputs


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_case(request, tiny_model_dir):
    target = tiny_model_dir(request.param)
    draft = tiny_model_dir(request.param, seed=7, num_layers=1)  # another random model, same tokenizer
    _, reference = _generate(target)
    return target, draft, _tokens(reference)


def _spec(method: str, draft) -> dict:
    return NGRAM if method == "ngram" else {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_output_unchanged_with_chunked_prefill_and_prefix_caching(arch_case, method):
    target, draft, reference = arch_case
    _, outputs = _generate(target, speculative_config=_spec(method, draft), max_num_batched_tokens=24)
    assert _tokens(outputs) == reference
    drafts = sum(o.metrics.spec_num_draft_tokens for o in outputs)
    assert drafts > 0  # speculation really ran


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_output_unchanged_under_preemption(arch_case, method):
    target, draft, reference = arch_case
    # 12 usable blocks of 16 tokens: six requests of up to 110 tokens cannot all stay resident.
    llm, outputs = _generate(
        target, speculative_config=_spec(method, draft), num_gpu_blocks_override=13, max_model_len=128
    )
    assert llm.llm_engine.engine_core.scheduler.total_preemptions > 0
    assert _tokens(outputs) == reference


def test_ngram_accepts_proposals_on_repetitive_output(llama_model_dir):
    _, outputs = _generate(llama_model_dir, speculative_config=NGRAM)
    accepted = sum(o.metrics.spec_num_accepted_tokens for o in outputs)
    proposed = sum(o.metrics.spec_num_draft_tokens for o in outputs)
    assert 0 < accepted <= proposed


def test_draft_equal_to_target_accepts_every_proposal(llama_model_dir):
    spec = {"method": "draft_model", "model": str(llama_model_dir), "num_speculative_tokens": 4}
    _, outputs = _generate(llama_model_dir, speculative_config=spec)
    for output in outputs:
        m = output.metrics
        assert m.spec_num_draft_tokens > 0
        assert m.spec_acceptance_rate == 1.0
        assert m.spec_mean_accepted_length > 3  # k + 1 = 5 tokens per step, less the capped last steps


def test_logprobs_are_the_target_models(llama_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3)
    _, plain = _generate(llama_model_dir, params)
    _, spec = _generate(llama_model_dir, params, speculative_config=NGRAM)
    assert sum(o.metrics.spec_num_accepted_tokens for o in spec) > 0
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pos_a, pos_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pos_a.keys() == pos_b.keys()
            for token, lp in pos_a.items():
                assert pos_b[token].logprob == pytest.approx(lp.logprob, abs=1e-4)


def test_requests_that_cannot_speculate_decode_normally(llama_model_dir):
    """Penalties and pending min_tokens depend on each position's prefix: no proposals for
    those requests, and their output is what the plain engine gives."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, min_tokens=30),
    ]
    prompts = _prompts()[:2]
    _, plain = _generate(llama_model_dir, params, prompts)
    _, spec = _generate(llama_model_dir, params, prompts, speculative_config=NGRAM)
    assert _tokens(spec) == _tokens(plain)
    assert all(o.metrics.spec_num_draft_tokens == 0 for o in spec)


def test_sampled_distribution_matches_plain_sampling(tiny_model_dir):
    """Chi-square test of homogeneity over the first two sampled tokens: the second is the first
    one verified against proposals from a different draft model."""
    scipy_stats = pytest.importorskip("scipy.stats")
    target = tiny_model_dir("llama", hidden_size=32, num_layers=1)
    draft = tiny_model_dir("llama", hidden_size=32, num_layers=1, seed=11)
    n = 1500
    prompt = [{"prompt_token_ids": [5, 9, 14, 3]}]
    spec_cfg = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}

    def sample(offset: int, **kwargs) -> list[tuple[int, int]]:
        params = [
            SamplingParams(temperature=1.5, top_k=4, max_tokens=4, ignore_eos=True, seed=offset + i) for i in range(n)
        ]
        llm = LLM(str(target), max_model_len=64, max_num_seqs=256, **kwargs)
        outputs = llm.generate(prompt * n, params, use_tqdm=False)
        llm.llm_engine.check_integrity()
        assert kwargs.get("speculative_config") is None or sum(o.metrics.spec_num_draft_tokens for o in outputs)
        return [tuple(o.outputs[0].token_ids[:2]) for o in outputs]

    plain, spec = sample(0), sample(10 * n, speculative_config=spec_cfg)
    cells = sorted(set(plain) | set(spec))
    table = [[plain.count(c) for c in cells], [spec.count(c) for c in cells]]
    keep = [j for j in range(len(cells)) if table[0][j] + table[1][j] >= 10]  # chi-square needs fat cells
    table = [[row[j] for j in keep] for row in table]
    _, p_value, _, _ = scipy_stats.chi2_contingency(table)
    assert p_value > 1e-3, (cells, table)


def test_draft_model_sees_every_prefill_chunk(llama_model_dir):
    """A 100-token prompt in 16-token chunks: most chunk steps sample nothing, and the draft must
    still fill its KV for them, or its guesses (here: the target itself) would stop matching."""
    spec = {"method": "draft_model", "model": str(llama_model_dir), "num_speculative_tokens": 3}
    prompts = [list(range(20, 120))]
    _, outputs = _generate(llama_model_dir, GREEDY, prompts, speculative_config=spec, max_num_batched_tokens=16)
    assert outputs[0].metrics.spec_acceptance_rate == 1.0


def test_draft_model_runs_up_to_max_model_len(llama_model_dir):
    """Draft and target both allow exactly max_model_len positions; accepting every proposal
    right up to the end must not run the draft past its position table."""
    spec = {"method": "draft_model", "model": str(llama_model_dir), "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)  # max_model_len binds
    _, outputs = _generate(llama_model_dir, params, [list(range(20, 500))], speculative_config=spec, max_model_len=512)
    assert len(outputs[0].outputs[0].token_ids) == 512 - 480
    assert outputs[0].outputs[0].finish_reason == "length"
