"""rejection_sample: exact greedy outputs, edge cases, seeding, and chi-square tests of exactness."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sampling.rejection_sampler import rejection_sample

V = 6


def _peaked(argmaxes: list[int], vocab: int = V) -> torch.Tensor:
    """Rows whose argmax is the given token (the rest of the mass spread evenly)."""
    probs = torch.full((len(argmaxes), vocab), 0.5 / (vocab - 1))
    probs[torch.arange(len(argmaxes)), torch.tensor(argmaxes, dtype=torch.int64)] = 0.5
    return probs


def _sample(
    target_probs: torch.Tensor,
    drafts: list[int],
    num_draft_tokens: list[int],
    bonus: list[int],
    greedy: list[bool],
    draft_probs: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> list[list[int]]:
    return rejection_sample(
        target_probs,
        target_probs.argmax(dim=1),
        torch.tensor(drafts, dtype=torch.int64),
        draft_probs,
        num_draft_tokens,
        torch.tensor(bonus, dtype=torch.int64),
        greedy,
        generators,
    )


# --------------------------------------------------------------------------- greedy
def test_greedy_exact_outputs() -> None:
    # Five requests, the target's argmax is 1, 2, 3 for each three-draft request.
    argmaxes = [1, 2, 3] * 4
    drafts = [
        1,
        2,
        3,  # all accepted -> bonus appended
        0,
        2,
        3,  # rejected at the first -> argmax there
        1,
        0,
        3,  # rejected in the middle (later drafts ignored even though they match)
        1,
        2,
        0,  # rejected at the last
    ]
    out = _sample(_peaked(argmaxes), drafts, [3, 3, 3, 3, 0], [4, 4, 4, 4, 5], [True] * 5)
    assert out == [[1, 2, 3, 4], [1], [1, 2], [1, 2, 3], [5]]


def test_greedy_ignores_draft_probs_and_generators() -> None:
    probs = _peaked([2, 4])
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    out = _sample(probs, [2, 4], [2], [1], [True], draft_probs=probs.flip(1), generators={0: generator})
    assert out == [[2, 4, 1]]
    assert torch.equal(generator.get_state(), state)  # a greedy request's generator is left untouched


def test_zero_drafts_everywhere() -> None:
    empty = torch.empty((0, V))
    assert _sample(empty, [], [0, 0], [3, 1], [True, False]) == [[3], [1]]


# --------------------------------------------------------------------------- random
def _random_distributions(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    dist = torch.rand((rows, V), generator=generator).add_(0.05)
    return dist / dist.sum(dim=1, keepdim=True)


def _batched(dist: torch.Tensor, n: int) -> torch.Tensor:
    """``dist`` [k, V] repeated for n requests, request-major: [n * k, V]."""
    return dist.repeat(n, 1)


def _draw(dist: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """[n * k] draft tokens, request-major: row j of each request drawn from dist[j]."""
    return torch.multinomial(dist, n, replacement=True, generator=generator).T.reshape(-1)


def test_draft_equal_to_target_is_always_accepted() -> None:
    n, k = 500, 3
    dist = _random_distributions(k, seed=1)
    drafts = _draw(dist, n, torch.Generator().manual_seed(2)).tolist()
    probs = _batched(dist, n)
    out = _sample(probs, drafts, [k] * n, [5] * n, [False] * n, draft_probs=probs.clone())
    assert out == [drafts[i * k : (i + 1) * k] + [5] for i in range(n)]


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_draft_impossible_under_target_is_always_rejected(with_draft_probs: bool) -> None:
    n, k, x = 2000, 2, 3
    target = _random_distributions(k, seed=3)
    target[:, x] = 0.0
    draft_probs = _batched(_random_distributions(k, seed=4), n) if with_draft_probs else None
    out = _sample(_batched(target, n), [x] * (n * k), [k] * n, [0] * n, [False] * n, draft_probs=draft_probs)
    assert all(len(tokens) == 1 for tokens in out)
    assert x not in {tokens[0] for tokens in out}


def test_seeded_request_is_reproducible_whatever_the_batch() -> None:
    k = 4
    target, draft = _random_distributions(k, seed=5), _random_distributions(k, seed=6)
    drafts = _draw(draft, 1, torch.Generator().manual_seed(7)).tolist()

    def alone(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return _sample(target, drafts, [k], [9], [False], draft_probs=draft, generators={0: gen})[0]

    def in_batch(seed: int) -> list[int]:
        # Others before it: a random request, a greedy one, one with no drafts, and one after.
        others = _random_distributions(3 + 2 + 1, seed=8)
        probs = torch.cat([others[:5], target, others[5:]])
        batch_drafts = [0, 1, 2, 3, 4, *drafts, 5]
        torch.rand(17)  # move the global RNG along: unseeded requests must not matter
        gens = {3: torch.Generator().manual_seed(seed), 4: torch.Generator().manual_seed(99)}
        out = _sample(
            probs,
            batch_drafts,
            [3, 2, 0, k, 1],
            [1, 1, 1, 9, 1],
            [False, True, False, False, False],
            draft_probs=torch.cat([others[:5], draft, others[5:]]),
            generators=gens,
        )
        return out[3]

    for seed in range(20):
        assert alone(seed) == in_batch(seed) == alone(seed)
    assert len({tuple(alone(seed)) for seed in range(20)}) > 1  # the seed really does matter


def test_inputs_are_not_modified() -> None:
    n, k = 50, 2
    probs, draft = _batched(_random_distributions(k, seed=9), n), _batched(_random_distributions(k, seed=10), n)
    args = (probs, probs.argmax(dim=1), _draw(draft[:k], n, torch.Generator().manual_seed(0)), draft)
    copies = [t.clone() for t in args]
    bonus = torch.zeros(n, dtype=torch.int64)
    rejection_sample(*args, [k] * n, bonus, [False] * n)
    rejection_sample(args[0], args[1], args[2], None, [k] * n, bonus, [False] * n)
    assert all(torch.equal(a, c) for a, c in zip(args, copies))
    assert torch.equal(bonus, torch.zeros(n, dtype=torch.int64))


@pytest.mark.parametrize(
    ("num_draft_tokens", "bonus", "greedy"),
    [
        ([1, 2], [0, 0], [True, True]),  # 3 drafts for 4 rows
        ([2, 2], [0], [True, True]),  # one bonus token short
        ([2, 2], [0, 0], [True]),  # one is_greedy short
        ([5, -1], [0, 0], [True, True]),  # negative count
    ],
)
def test_mismatched_inputs_raise(num_draft_tokens: list[int], bonus: list[int], greedy: list[bool]) -> None:
    with pytest.raises(ValueError):
        _sample(_peaked([1, 2, 3, 4]), [1, 2, 3, 4], num_draft_tokens, bonus, greedy)


# --------------------------------------------------------------------------- exactness (chi-square)
# Per-position target (P) and draft (Q) distributions that differ a lot; P[3] is the bonus position.
P = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.10, 0.10, 0.00],
        [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
        [0.15, 0.35, 0.05, 0.05, 0.30, 0.10],
        [0.20, 0.10, 0.30, 0.10, 0.05, 0.25],
    ]
)
Q = torch.tensor(
    [
        [0.05, 0.10, 0.15, 0.20, 0.20, 0.30],  # mass on token 5, which the target forbids at position 0
        [0.30, 0.30, 0.20, 0.10, 0.05, 0.05],
        [0.10, 0.05, 0.40, 0.25, 0.10, 0.10],
    ]
)
NUM_REQUESTS = 20_000
# Chi-square critical values at p = 0.001 by degrees of freedom (scipy.stats.chi2.ppf(0.999, dof)),
# hard-coded so the test needs no scipy.
CHI2_CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def _speculate(k: int, mode: str, seed: int = 0) -> tuple[list[list[int]], torch.Tensor]:
    """NUM_REQUESTS random requests with drafts from Q ("q", "none_random") or always token 2 ("none_fixed").

    Returns the outputs and the drafts [n, k]. Verification gets Q only in mode "q".
    """
    n = NUM_REQUESTS
    generator = torch.Generator().manual_seed(seed)
    drafts = torch.full((n * k,), 2) if mode == "none_fixed" else _draw(Q[:k], n, generator)
    bonus = torch.multinomial(P[k], n, replacement=True, generator=generator)
    target = _batched(P[:k], n)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        out = rejection_sample(
            target,
            target.argmax(dim=1),
            drafts,
            _batched(Q[:k], n) if mode == "q" else None,
            [k] * n,
            bonus,
            [False] * n,
        )
    return out, drafts.view(n, k)


def _chi2(tokens: list[int], expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and dof over the support of ``expected_probs``; mass outside it is an error."""
    observed = torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=V).double()
    support = expected_probs > 0
    assert observed[~support].sum() == 0, "emitted a token the target gives probability 0"
    expected = expected_probs[support].double() * len(tokens)
    stat = ((observed[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


def _acceptance(j: int, mode: str) -> float:
    """Theoretical probability that the draft at position j is accepted."""
    if mode == "q":
        return torch.minimum(P[j], Q[j]).sum().item()
    if mode == "none_random":
        return (Q[j] * P[j]).sum().item()
    return P[j, 2].item()


@pytest.mark.parametrize("mode", ["q", "none_random", "none_fixed"])
@pytest.mark.parametrize("k", [1, 3])
def test_emitted_tokens_follow_the_target(k: int, mode: str) -> None:
    out, _ = _speculate(k, mode)
    checked = 0
    for j in range(k + 1):
        # Token j exists iff drafts 0..j-1 were accepted; P is fixed per position, so given that
        # it must be distributed as P[j] (the bonus token's distribution for j == k).
        tokens = [o[j] for o in out if len(o) > j]
        if j < k:
            reached_next = sum(len(o) > j + 1 for o in out)
            rate, total = _acceptance(j, mode), len(tokens)
            z = (reached_next - rate * total) / (rate * (1 - rate) * total) ** 0.5
            assert abs(z) < 4.5, f"position {j}: acceptance {reached_next}/{total}, expected rate {rate}"
        if len(tokens) * P[j][P[j] > 0].min() < 5:
            continue  # too few samples for a chi-square test
        stat, dof = _chi2(tokens, P[j])
        assert stat < CHI2_CRITICAL[dof], f"position {j}: chi2 {stat:.1f} over {len(tokens)} samples"
        checked += 1
    assert checked >= min(k + 1, 2)


def test_chi_square_has_power_against_plausible_bugs() -> None:
    out, drafts = _speculate(3, "q")
    stat, dof = _chi2([o[0] for o in out], P[0])
    assert stat < CHI2_CRITICAL[dof]
    # Bug 1, accept every draft: the first token would follow Q[0] (even hitting P's zero).
    accept_all = drafts[:, 0]
    assert (accept_all == 5).any()
    stat, _ = _chi2([t for t in accept_all.tolist() if t != 5], P[0])
    assert stat > 50 * CHI2_CRITICAL[dof]
    # Bug 2, recover from p instead of max(0, p - q): the first token would follow
    # min(p, q) + (1 - beta) p. Our samples must reject that distribution overwhelmingly.
    overlap = torch.minimum(P[0], Q[0])
    buggy = overlap + (1 - overlap.sum()) * P[0]
    stat, _ = _chi2([o[0] for o in out], buggy)
    assert stat > 50 * CHI2_CRITICAL[dof]
