"""Sampler end to end: greedy/random mixing, seeding, statistics, constraints, logprobs."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sampling import Sampler, SamplingMetadata, compute_logprobs_topk
from pagedllm.sampling_params import SamplingParams

V = 6


def _md(params: list[SamplingParams], outputs=None, prompts=None, vocab=V, generators=None, eos=None):
    n = len(params)
    return SamplingMetadata.from_params(
        params,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        vocab_size=vocab,
        generators=generators,
        eos_token_id=eos,
    )


def _sample(logits: torch.Tensor, params: list[SamplingParams], **kw):
    return Sampler().sample(logits, _md(params, vocab=logits.shape[1], **kw))


# --------------------------------------------------------------------------- metadata builder
def test_from_params_leaves_unused_features_off() -> None:
    md = _md([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)])
    assert md.all_greedy and not md.all_random and md.temperature is None
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.no_penalties and md.prompt_token_ids is None and md.allowed_token_ids_mask is None
    assert md.max_num_logprobs is None and md.min_tokens == {}


def test_from_params_fills_per_row_tensors() -> None:
    params = [SamplingParams(top_k=3, logprobs=2, repetition_penalty=1.5), SamplingParams(temperature=0.0, logprobs=5)]
    md = _md(params, prompts=[[1, 2], [3]], outputs=[[4], []])
    assert md.temperature.tolist() == [1.0, 0.0] and not md.all_greedy and not md.all_random
    assert md.top_k.tolist() == [3, 0] and md.max_num_logprobs == 5 and not md.no_penalties
    assert md.prompt_token_ids.tolist() == [[1, 2], [3, V]]
    assert md.repetition_penalties.tolist() == [1.5, 1.0]


# --------------------------------------------------------------------------- greedy / top-k
def test_greedy_is_argmax() -> None:
    logits = torch.randn(8, 50)
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs_tensors is None


def test_top_k_one_equals_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 50)
    out = _sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 16)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy() -> None:
    logits = torch.randn(16, 50)
    out = _sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 16)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_argmax_random_rows_sample() -> None:
    torch.manual_seed(0)
    logits = torch.zeros(4, 1000)  # flat: random rows almost never hit the argmax (token 0)
    logits[:, 7] = 0.5  # greedy rows must pick 7
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0), SamplingParams()]
    tokens = _sample(logits, params).sampled_token_ids.tolist()
    assert tokens[0] == tokens[2] == 7
    assert tokens[1] != 7 or tokens[3] != 7


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(2, V)
    before = logits.clone()
    _sample(logits, [SamplingParams(top_k=2, repetition_penalty=2.0, logit_bias={1: 5.0})] * 2, outputs=[[1], [2]])
    assert torch.equal(logits, before)


# --------------------------------------------------------------------------- seeding
def _seeded_run(other_rows: int, position: int, other_logits_seed: int, seed: int = 7, steps: int = 20) -> list[int]:
    """Sample ``steps`` tokens for one seeded row placed among ``other_rows`` unseeded rows."""
    generator = torch.Generator().manual_seed(seed)
    own = torch.Generator().manual_seed(99)  # the seeded row's logits: same in every run
    others = torch.Generator().manual_seed(other_logits_seed)
    tokens = []
    for _ in range(steps):
        row_logits = torch.randn(1, 100, generator=own)
        logits = torch.randn(other_rows + 1, 100, generator=others)
        logits[position] = row_logits[0]
        params = [SamplingParams(top_k=50 if i % 2 else 0) for i in range(other_rows + 1)]
        params[position] = SamplingParams(seed=seed, temperature=0.8)
        out = _sample(logits, params, generators={position: generator})
        tokens.append(out.sampled_token_ids[position].item())
    return tokens


def test_seeded_row_same_alone_and_in_different_batches() -> None:
    alone = _seeded_run(other_rows=0, position=0, other_logits_seed=1)
    torch.manual_seed(11)
    batch_a = _seeded_run(other_rows=3, position=2, other_logits_seed=2)
    torch.manual_seed(22)
    batch_b = _seeded_run(other_rows=6, position=5, other_logits_seed=3)
    assert alone == batch_a == batch_b
    assert len(set(alone)) > 1  # it really samples
    assert _seeded_run(other_rows=0, position=0, other_logits_seed=1, seed=8) != alone


# --------------------------------------------------------------------------- statistics
PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4])


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampling_frequencies_match_tempered_distribution(temperature: float) -> None:
    torch.manual_seed(0)
    n = 20_000
    logits = PROBS.log().repeat(n, 1)
    tokens = _sample(logits, [SamplingParams(temperature=temperature)] * n).sampled_token_ids
    observed = torch.bincount(tokens, minlength=4).float() / n
    expected = PROBS ** (1 / temperature)
    expected /= expected.sum()
    assert torch.allclose(observed, expected, atol=0.02), (observed, expected)


def test_min_p_sampling_never_draws_filtered_tokens() -> None:
    n = 5000
    logits = PROBS.log().repeat(n, 1)
    tokens = _sample(logits, [SamplingParams(min_p=0.6)] * n).sampled_token_ids
    assert set(tokens.tolist()) == {2, 3}  # threshold 0.6 * 0.4 = 0.24 drops 0.1 and 0.2


# --------------------------------------------------------------------------- constraints in the sampler
def test_allowed_token_ids_restrict_random_and_greedy_rows() -> None:
    logits = torch.randn(400, V)
    params = [SamplingParams(allowed_token_ids=[1, 4]), SamplingParams(temperature=0.0, allowed_token_ids=[2])] * 200
    tokens = _sample(logits, params).sampled_token_ids
    assert set(tokens[0::2].tolist()) <= {1, 4} and set(tokens[1::2].tolist()) == {2}


def test_logit_bias_steers_greedy() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, 0.0, 0.0]])
    out = _sample(logits, [SamplingParams(temperature=0.0, logit_bias={4: 3.5})])
    assert out.sampled_token_ids.tolist() == [4]


def test_min_tokens_blocks_eos_then_releases() -> None:
    eos = 5
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 9.0]]).repeat(4, 1)  # EOS is the favourite
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2])] * 4
    outputs = [[], [1], [1, 1], [1, 1, 1]]
    tokens = _sample(logits, params, outputs=outputs, eos=eos).sampled_token_ids
    assert tokens.tolist() == [1, 1, 1, eos]


def test_min_tokens_ignore_eos_does_not_block_eos() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 9.0]])
    params = [SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)]
    assert _sample(logits, params, eos=5).sampled_token_ids.tolist() == [5]


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    assert _sample(logits, params, prompts=[[3]], outputs=[[0]]).sampled_token_ids.tolist() == [1]
    params = [SamplingParams(temperature=0.0, presence_penalty=0.2)]
    assert _sample(logits, params, prompts=[[0]], outputs=[[]]).sampled_token_ids.tolist() == [0]


# --------------------------------------------------------------------------- logprobs
def test_logprobs_are_raw_even_with_processing() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 30)
    params = [
        SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.8, frequency_penalty=1.0, logprobs=3),
        SamplingParams(temperature=0.0, presence_penalty=2.0, logit_bias={0: 50.0}, logprobs=1),
        SamplingParams(temperature=1.3, min_p=0.1, logprobs=0),
    ] * 2
    outputs = [[1, 2, 2], [3], [], [4, 4], [0], [5]]
    out = _sample(logits, params, outputs=outputs, prompts=[[7]] * 6)
    lp = out.logprobs_tensors
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert lp.logprob_token_ids.shape == (6, 4) and lp.logprobs.shape == (6, 4)
    assert torch.equal(lp.logprob_token_ids[:, 0], sampled)
    assert torch.allclose(lp.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    assert sampled[1].item() == 0 and sampled[4].item() == 0  # the bias decided, not the raw logits
    expected_ranks = [(raw[i] > raw[i, t]).sum().item() + 1 for i, t in enumerate(sampled.tolist())]
    assert lp.selected_token_ranks.tolist() == expected_ranks
    order = raw.argsort(dim=-1, descending=True)[:, :3]
    assert torch.equal(lp.logprob_token_ids[:, 1:], order)
    assert torch.all(lp.logprobs[:, 1:-1] >= lp.logprobs[:, 2:])  # best first


def test_compute_logprobs_topk_hand_values() -> None:
    logits = torch.tensor([[0.0, 0.0, 2.0, 1.0], [1.0, 3.0, 2.0, 0.0]])
    lp = compute_logprobs_topk(logits, 2, torch.tensor([3, 1]))
    ids, values, ranks = lp.tolists()
    assert ids == [[3, 2, 3], [1, 1, 2]]
    assert ranks == [2, 1]
    expected = torch.log_softmax(logits, -1)
    assert values[0] == pytest.approx([expected[0, 3].item(), expected[0, 2].item(), expected[0, 3].item()])
    assert compute_logprobs_topk(logits, 0, torch.tensor([0, 0])).logprobs.shape == (2, 1)


def test_empty_batch() -> None:
    out = _sample(torch.zeros(0, V), [])
    assert out.sampled_token_ids.shape == (0,)
