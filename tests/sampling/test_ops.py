"""Sampling ops against hand-computed expectations on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.sampling import ops, pad_token_ids

INF = float("inf")


def _probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


# --------------------------------------------------------------------------- penalties
def _penalise(logits, prompt, output, pres=0.0, freq=0.0, rep=1.0):
    n, v = logits.shape
    return ops.apply_penalties(
        logits.clone(),
        pad_token_ids(prompt, v),
        pad_token_ids(output, v),
        torch.full((n,), pres),
        torch.full((n,), freq),
        torch.full((n,), rep),
    )


LOGITS = torch.tensor([[2.0, -1.0, 0.5, -2.0, 1.0, 0.0]])


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    # Seen: 0, 1 (prompt) and 2, 3 (output). 4 and 5 are untouched.
    out = _penalise(LOGITS, [[0, 1]], [[2, 2, 3]], rep=2.0)
    assert out.tolist() == [[1.0, -2.0, 0.25, -4.0, 1.0, 0.0]]


def test_repetition_penalty_below_one_boosts_seen_tokens() -> None:
    out = _penalise(LOGITS, [[0]], [[1]], rep=0.5)
    assert out.tolist() == [[4.0, -0.5, 0.5, -2.0, 1.0, 0.0]]


def test_frequency_penalty_counts_output_only() -> None:
    # Prompt tokens are not counted; token 2 appears twice in the output, token 3 once.
    out = _penalise(LOGITS, [[0, 4]], [[2, 2, 3]], freq=0.5)
    assert out.tolist() == [[2.0, -1.0, -0.5, -2.5, 1.0, 0.0]]


def test_presence_penalty_is_per_distinct_output_token() -> None:
    out = _penalise(LOGITS, [[0]], [[2, 2, 3]], pres=0.25)
    assert out.tolist() == [[2.0, -1.0, 0.25, -2.25, 1.0, 0.0]]


def test_all_penalties_combined_and_rows_independent() -> None:
    logits = torch.cat([LOGITS, LOGITS])
    v = logits.shape[1]
    out = ops.apply_penalties(
        logits.clone(),
        pad_token_ids([[0, 1], [5]], v),  # ragged: row 1 padded with vocab_size
        pad_token_ids([[2, 2, 3], []], v),
        torch.tensor([0.25, 0.0]),
        torch.tensor([0.5, 0.0]),
        torch.tensor([2.0, 1.0]),
    )
    # rep: 0 -> 1.0, 1 -> -2.0, 2 -> 0.25, 3 -> -4.0; freq: 2 -= 1.0, 3 -= 0.5; pres: 2, 3 -= 0.25
    assert out[0].tolist() == [1.0, -2.0, -1.0, -4.75, 1.0, 0.0]
    assert out[1].tolist() == LOGITS[0].tolist()


def test_penalties_without_prompt_tensor() -> None:
    out = ops.apply_penalties(
        LOGITS.clone(), None, pad_token_ids([[0]], 6), torch.zeros(1), torch.zeros(1), torch.tensor([2.0])
    )
    assert out.tolist() == [[1.0, -1.0, 0.5, -2.0, 1.0, 0.0]]


def test_distinct_tokens_counted_and_padding_dropped() -> None:
    ids, first, counts = ops._distinct(pad_token_ids([[3, 1, 1], [], [0], [2, 2, 2]], 4), 4)
    # Sorted: [1, 1, 3], padding only, [0, pad, pad], [2, 2, 2].
    assert (ids * first).tolist() == [[1, 0, 3], [0, 0, 0], [0, 0, 0], [2, 0, 0]]
    assert first.tolist() == [[True, False, True], [False] * 3, [True, False, False], [True, False, False]]
    assert (counts * first).tolist() == [[2, 0, 1], [0, 0, 0], [1, 0, 0], [3, 0, 0]]


def _dense_penalties(logits, prompt, output, pres, freq, rep):
    """The penalties over dense [N, V] counts (the reference)."""
    v = logits.shape[1]

    def counts(ids):
        c = torch.zeros((ids.shape[0], v + 1), dtype=torch.int64).scatter_add_(1, ids, torch.ones_like(ids))
        return c[:, :v]

    out_counts = counts(output)
    seen = (out_counts > 0) | (counts(prompt) > 0)
    scale = torch.where(seen, rep.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits -= freq.unsqueeze(1) * out_counts
    logits -= pres.unsqueeze(1) * (out_counts > 0)
    return logits


def test_sparse_penalties_equal_the_dense_reference_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    n, v = 9, 50
    logits = torch.randn(n, v, generator=gen) * 3
    logits[2, 7] = -INF  # a token an earlier constraint masked stays masked
    lengths = torch.randint(0, 12, (2, n), generator=gen).tolist()
    prompt = [torch.randint(0, v, (k,), generator=gen).tolist() for k in lengths[0]]
    output = [torch.randint(0, 8, (k,), generator=gen).tolist() for k in lengths[1]]  # repeats
    output[2] += [7, 7]
    pres, freq = torch.rand(n, generator=gen), torch.rand(n, generator=gen) * 2 - 0.5
    rep = torch.rand(n, generator=gen) + 0.5
    sparse = ops.apply_penalties(logits.clone(), pad_token_ids(prompt, v), pad_token_ids(output, v), pres, freq, rep)
    dense = _dense_penalties(logits.clone(), pad_token_ids(prompt, v), pad_token_ids(output, v), pres, freq, rep)
    assert torch.equal(sparse, dense)


# --------------------------------------------------------------------------- constraints
def test_logit_bias_adds_per_row() -> None:
    out = ops.apply_logit_bias(torch.ones(3, 6), [{1: 2.5, 4: -100.0}, None, {0: -1.0}])
    assert out.tolist() == [
        [1.0, 3.5, 1.0, 1.0, -99.0, 1.0],
        [1.0] * 6,
        [0.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    ]


def test_logit_bias_none_everywhere_is_noop() -> None:
    logits = torch.ones(2, 6)
    assert ops.apply_logit_bias(logits, [None, {}]).tolist() == [[1.0] * 6] * 2


def test_allowed_token_mask_bans_the_rest() -> None:
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, [1, 3]] = False
    mask[1] = False  # row 1 unrestricted
    out = ops.apply_allowed_token_mask(torch.zeros(2, 6), mask)
    assert out.tolist() == [[-INF, 0.0, -INF, 0.0, -INF, -INF], [0.0] * 6]
    assert ops.apply_allowed_token_mask(torch.zeros(1, 6), None).tolist() == [[0.0] * 6]


def test_min_tokens_blocks_stop_ids_until_reached() -> None:
    rules = {0: (2, {5, 3}), 1: (2, {5}), 2: (1, {0})}
    out = ops.apply_min_tokens(torch.zeros(3, 6), [[1], [1, 2], []], rules)
    # Row 0 has 1 < 2 tokens: blocked. Row 1 reached 2: released. Row 2 has 0 < 1: blocked.
    assert out.tolist() == [
        [0.0, 0.0, 0.0, -INF, 0.0, -INF],
        [0.0] * 6,
        [-INF, 0.0, 0.0, 0.0, 0.0, 0.0],
    ]


# --------------------------------------------------------------------------- temperature / top-k / top-p / min-p
def test_temperature_divides_random_rows_and_leaves_greedy_rows() -> None:
    out = ops.apply_temperature(torch.tensor([[2.0, -4.0], [2.0, -4.0]]), torch.tensor([0.5, 0.0]))
    assert out.tolist() == [[4.0, -8.0], [2.0, -4.0]]


def test_top_k_keeps_k_largest_and_zero_disables() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 2.0, 4.0]] * 3)
    out = ops.apply_top_k_top_p(logits.clone(), torch.tensor([2, 0, 99]), None)
    assert out[0].tolist() == [-INF, 5.0, -INF, -INF, 4.0]
    assert out[1].tolist() == logits[1].tolist()  # 0 = off
    assert out[2].tolist() == logits[2].tolist()  # k > V clamps to V


@pytest.mark.parametrize("p, kept", [(0.75, [0, 1]), (0.85, [0, 1, 2]), (1.0, [0, 1, 2, 3]), (1e-6, [0])])
def test_top_p_keeps_smallest_nucleus(p: float, kept: list[int]) -> None:
    # Sorted ascending: 0.05, 0.15, 0.3, 0.5 -> cumsum 0.05, 0.2, 0.5, 1.0; drop tail mass <= 1 - p.
    logits = _probs_logits([0.5, 0.3, 0.15, 0.05])
    out = ops.apply_top_k_top_p(logits.clone(), None, torch.tensor([p]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == kept


def test_top_k_and_top_p_keep_at_least_one_token() -> None:
    uniform = torch.zeros(2, 8)
    out = ops.apply_top_k_top_p(uniform.clone(), None, torch.tensor([1e-9, 1e-9]))
    assert torch.isfinite(out).sum(dim=-1).tolist() == [1, 1]
    out = ops.apply_top_k_top_p(torch.randn(2, 8), torch.tensor([1, 1]), torch.tensor([1e-9, 1e-9]))
    assert torch.isfinite(out).sum(dim=-1).tolist() == [1, 1]


def test_top_k_and_top_p_together_per_row() -> None:
    logits = _probs_logits([0.4, 0.3, 0.2, 0.1]).repeat(2, 1)
    # Row 0: top-k 3 then nucleus 0.6 of the renormalised rest; row 1: only top-k 2.
    out = ops.apply_top_k_top_p(logits.clone(), torch.tensor([3, 2]), torch.tensor([0.6, 1.0]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 1]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [0, 1]
    assert out[0, 0].item() == pytest.approx(math.log(0.4))  # kept values are unchanged


@pytest.mark.parametrize("min_p, kept", [(0.0, [0, 1, 2, 3]), (0.2, [0, 1, 2]), (0.5, [0, 1]), (1.0, [0])])
def test_min_p_drops_tokens_below_fraction_of_max(min_p: float, kept: list[int]) -> None:
    # Thresholds: 0.2 * 0.5 = 0.1 (drops 0.05); 0.5 * 0.5 = 0.25 (drops 0.15 too).
    logits = _probs_logits([0.5, 0.3, 0.15, 0.05])
    out = ops.apply_min_p(logits.clone(), torch.tensor([min_p]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == kept


def test_random_sample_never_picks_zero_probability() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).repeat(1000, 1)
    tokens = ops.random_sample(probs, {})
    assert set(tokens.tolist()) == {1, 3}


def test_random_sample_seeded_row_uses_only_its_generator() -> None:
    probs = torch.full((3, 50), 1 / 50)
    first = ops.random_sample(probs.clone(), {1: torch.Generator().manual_seed(3)})
    torch.manual_seed(1234)  # change the global stream: the seeded row must not care
    second = ops.random_sample(probs.clone(), {1: torch.Generator().manual_seed(3)})
    assert first[1].item() == second[1].item()


def test_random_sample_follows_unnormalised_weights() -> None:
    torch.manual_seed(0)
    weights = torch.tensor([[0.3, 0.0, 0.6, 0.9, 1.2]])  # 0.1 / 0 / 0.2 / 0.3 / 0.4 of the mass
    tokens = ops.random_sample(weights.repeat(20_000, 1), {})
    freq = torch.bincount(tokens, minlength=5).double() / 20_000
    # 3.5 standard deviations of a frequency near 0.25 over 20k draws is 0.011.
    assert torch.allclose(freq, torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4], dtype=torch.float64), atol=0.011)


@pytest.mark.parametrize("top", [1.0 - 2.0**-24, 1.0])
def test_random_sample_at_the_top_of_the_uniform_range_picks_the_last_weighted_token(monkeypatch, top) -> None:
    # The draw must end on a weighted token, not the zero-weight ones after it, even for a
    # uniform number of exactly 1 (u * total == total).
    monkeypatch.setattr(ops.torch, "rand", lambda n, **kw: torch.full((n,), top))
    probs = torch.tensor([[0.75, 0.0, 2.25, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    assert ops.random_sample(probs, {}).tolist() == [2, 3, 2]


def test_random_sample_row_without_weight_draws_token_zero() -> None:
    probs = torch.tensor([[0.0, 0.0, 0.0], [float("nan")] * 3, [0.0, 0.0, 1.0]])
    assert ops.random_sample(probs, {}).tolist() == [0, 0, 2]


def test_top_k_top_p_ties_keep_the_sorts_count() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0]])
    # Four tied tokens of ~0.239 each: the nucleus of 0.5 keeps three of them (0, 0.239 and 0.478
    # above), which three is arbitrary in both paths.
    for path in (ops.apply_top_k_top_p, ops._sorted_top_k_top_p):
        kept = torch.isfinite(path(logits.clone(), None, torch.tensor([0.5])))[0]
        assert kept.sum().item() == 3 and not kept[[0, 4]].any()


def test_random_sample_draws_one_number_per_seeded_row() -> None:
    # A seeded row's generator advances by one draw per sample, whatever the vocabulary size.
    generator, twin = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    ops.random_sample(torch.full((2, 50_000), 1.0), {0: generator})
    torch.rand(1, generator=twin)
    assert torch.equal(generator.get_state(), twin.get_state())


# Peaked rows (nucleus among the candidates), nearly flat ones (sorted), a vocabulary below the
# candidate count; masked (-inf) tokens in some rows.
@pytest.mark.parametrize(
    "scale, vocab", [(8.0, 4 * ops.NUCLEUS_CANDIDATES), (0.05, 4 * ops.NUCLEUS_CANDIDATES), (2.0, 100)]
)
def test_top_k_top_p_by_selection_equals_the_sort(scale: float, vocab: int) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, vocab, generator=gen) * scale
    logits[3:6, ::3] = -INF
    small_k = torch.tensor([0, 5, 20, 0, 0, vocab, 20, 0, 1, 0, 24, 0])  # by selection
    large_k = torch.tensor([0, 5, 40, 0, 0, vocab, 3 * vocab // 4, 0, 1, 0, vocab // 2, 0])  # past a quarter: sorted
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.99, 1e-6, 0.7, 0.95, 1.0, 0.3, 0.6, 0.8, 0.999])
    for k, p in ((small_k, None), (large_k, None), (None, top_p), (small_k, top_p), (large_k, top_p)):
        selected = ops.apply_top_k_top_p(logits.clone(), k, p)
        sorted_ = ops._sorted_top_k_top_p(logits.clone(), k, p)
        assert torch.equal(torch.isfinite(selected), torch.isfinite(sorted_))
        assert torch.equal(selected[torch.isfinite(selected)], logits[torch.isfinite(selected)])


def test_min_p_in_logits_matches_the_probability_rule() -> None:
    # Mixed rows (min_p 0 = off), a row with masked tokens: the same kept set as p < min_p * p_max.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen) * 3
    logits[2, :500] = float("-inf")
    min_p = torch.tensor([0.0, 0.05, 0.1, 0.3, 0.9, 1.0])
    probs = logits.softmax(dim=-1)
    want = ~(probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)) & torch.isfinite(logits)
    out = ops.apply_min_p(logits.clone(), min_p)
    assert torch.equal(torch.isfinite(out), want)
    assert torch.equal(out[want], logits[want])  # kept values unchanged
