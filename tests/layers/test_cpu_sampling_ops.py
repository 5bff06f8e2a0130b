"""The sampler's CPU kernels (csrc/cpu_sampling.cpp) against torch on every ISA build this CPU
runs: argmax_rows against torch.argmax(dim=-1) (ties, NaN, infinities, tails, strided rows) and
mask_below_ against masked_fill_."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm.sampling import ops

INF, NAN = float("inf"), float("nan")


def check(isa_ops: Any, x: torch.Tensor) -> None:
    got = isa_ops.argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert got.tolist() == x.argmax(dim=-1).tolist()


@pytest.mark.parametrize("vocab", [1, 3, 15, 16, 17, 63, 64, 65, 100, 257, 4099, 49152])
def test_random_rows(isa_ops: Any, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    check(isa_ops, torch.randn(5, vocab, generator=gen))


@pytest.mark.parametrize("vocab", [17, 64, 100, 1000])
def test_ties_go_to_the_first_index(isa_ops: Any, vocab: int) -> None:
    # The maximum repeated in several lanes, vector steps and the scalar tail; small integers tie often.
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 4, (64, vocab), generator=gen).float()
    check(isa_ops, x)
    rows = []
    for positions in ([0, vocab - 1], [vocab - 1, 5], [3, 19, 35], [vocab // 2, vocab - 2], [16, 1]):
        row = torch.zeros(vocab)
        row[[p for p in positions if p < vocab]] = 2.0
        rows.append(row)
    check(isa_ops, torch.stack(rows))
    check(isa_ops, torch.zeros(3, vocab))  # every entry the maximum: index 0
    signed = torch.zeros(2, vocab)
    signed[0, ::2] = -0.0  # -0.0 == 0.0: still the first
    signed[1, 0] = -0.0
    check(isa_ops, signed)


@pytest.mark.parametrize("vocab", [5, 64, 129, 49152])
def test_nan_counts_as_the_largest_and_infinities(isa_ops: Any, vocab: int) -> None:
    rows = []
    for spot in (0, 1, vocab // 3, vocab - 1):
        row = torch.randn(vocab)
        row[spot] = NAN
        row[min(vocab - 1, spot + 2)] = NAN  # only the first one counts
        row[vocab // 2] = INF
        rows.append(row)
    rows.append(torch.full((vocab,), -INF))  # all masked: index 0
    masked = torch.full((vocab,), -INF)
    masked[vocab - 1] = -1e30
    rows.append(masked)
    with_inf = torch.randn(vocab)
    with_inf[[vocab // 4, vocab - 1]] = INF
    rows.append(with_inf)
    check(isa_ops, torch.stack(rows))


def test_strided_rows_and_empty_batch(isa_ops: Any) -> None:
    big = torch.randn(6, 300)
    check(isa_ops, big[:, 7:250])  # rows of a wider buffer
    check(isa_ops, big[::2])
    check(isa_ops, torch.randn(0, 10))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        isa_ops.argmax_rows(big.t())


def test_sampler_greedy_uses_it_and_agrees() -> None:
    logits = torch.randn(8, 1000)
    logits[2, 10] = NAN
    assert ops.greedy(logits).tolist() == logits.argmax(dim=-1).tolist()
    # Non-float32 or column-strided logits take torch's own argmax.
    assert ops.greedy(logits.double()).tolist() == logits.argmax(dim=-1).tolist()
    assert ops.greedy(logits.t()).tolist() == logits.t().argmax(dim=-1).tolist()


@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 49152])
def test_mask_below_matches_masked_fill(isa_ops: Any, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=gen)
    x[0, 0] = NAN
    x[1, -1] = -INF
    x[2, vocab // 2] = INF
    threshold = torch.tensor([0.0, -INF, 0.5, NAN, INF, -0.1])
    expected = x.clone().masked_fill_(x < threshold.unsqueeze(1), -INF)
    got = x.clone()
    isa_ops.mask_below_(got, threshold)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(0.0), expected.nan_to_num(0.0))
    wide = torch.randn(3, vocab + 5, generator=gen)
    rows = wide[:, 2 : 2 + vocab]  # rows of a wider buffer, written in place
    expected = rows.clone().masked_fill_(rows < 0.25, -INF)
    isa_ops.mask_below_(rows, torch.full((3,), 0.25))
    assert torch.equal(rows, expected)
    with pytest.raises(RuntimeError, match="one per row"):
        isa_ops.mask_below_(x, torch.zeros(2))
