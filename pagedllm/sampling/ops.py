"""Pure tensor ops that turn raw logits into a sampling distribution.

Every op takes ``logits`` of shape [N, V] (float32) plus per-row parameters and returns the
processed logits. Ops may write into ``logits`` in place (the Sampler hands them its own
copy), so callers must use the return value and must not rely on the input afterwards.
Semantics follow vLLM.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers.cpu_kernels import cpu_fp32_kernels
from pagedllm.sampling_params import SAMPLING_EPS

_NEG_INF = float("-inf")


def _row_kernels(logits: torch.Tensor) -> Any | None:
    """The CPU kernels when ``logits`` are float32 CPU rows [N, V] they take (contiguous rows)."""
    kernels = cpu_fp32_kernels(logits)
    return kernels if kernels is not None and logits.dim() == 2 and logits.stride(-1) == 1 else None


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, [N] int64, exactly as ``logits.argmax(dim=-1)`` (the first maximum; a
    row's first NaN, when it has one). Float32 CPU rows go through the vectorized kernel
    (``csrc/cpu_sampling.cpp``): torch's is a scalar loop, 2.5 ms for 64 rows of 49k tokens."""
    kernels = _row_kernels(logits)
    if kernels is not None and logits.shape[1] > 0:
        return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def mask_below_(logits: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """In place: every entry below its row's ``threshold`` [N] becomes -inf (NaN compares false
    and stays), as ``logits.masked_fill_(logits < threshold[:, None], -inf)``; the vectorized kernel
    on float32 CPU rows (torch's masked_fill_ is scalar: 6.5 ms for 64 rows of 49k tokens)."""
    kernels = _row_kernels(logits)
    if kernels is not None and threshold.dtype == torch.float32:
        kernels.mask_below_(logits, threshold)
        return logits
    return logits.masked_fill_(logits < threshold.unsqueeze(1), _NEG_INF)


# --------------------------------------------------------------------------- constraints
def apply_allowed_token_mask(logits: torch.Tensor, not_allowed: torch.Tensor | None) -> torch.Tensor:
    """Set tokens outside a row's ``allowed_token_ids`` to -inf (``not_allowed`` True = banned)."""
    if not_allowed is None:
        return logits
    return logits.masked_fill_(not_allowed, _NEG_INF)


def apply_bad_words(
    logits: torch.Tensor,
    output_token_ids: list[list[int]],
    bad_words_token_ids: dict[int, list[list[int]]],
) -> torch.Tensor:
    """Ban, per row, the last token of every bad-word sequence whose other tokens end the row's
    output (a one-token sequence is always banned). Only the output counts, not the prompt."""
    rows: list[int] = []
    cols: list[int] = []
    for row, sequences in bad_words_token_ids.items():
        output = output_token_ids[row]
        for sequence in sequences:
            prefix = len(sequence) - 1
            if prefix <= len(output) and output[len(output) - prefix :] == sequence[:prefix]:
                rows.append(row)
                cols.append(sequence[-1])
    if not rows:
        return logits
    return logits.index_put_(_index(rows, cols, logits.device), torch.tensor(_NEG_INF, device=logits.device))


def apply_logit_bias(logits: torch.Tensor, logit_bias: list[dict[int, float] | None]) -> torch.Tensor:
    """Add each row's ``{token_id: bias}`` to its logits in one scatter."""
    rows, cols, vals = [], [], []
    for row, bias in enumerate(logit_bias):
        for token_id, value in (bias or {}).items():
            rows.append(row)
            cols.append(token_id)
            vals.append(value)
    if not rows:
        return logits
    index = _index(rows, cols, logits.device)
    values = torch.tensor(vals, dtype=logits.dtype, device=logits.device)
    return logits.index_put_(index, values, accumulate=True)


def apply_min_tokens(
    logits: torch.Tensor,
    output_token_ids: list[list[int]],
    min_tokens: dict[int, tuple[int, set[int]]],
) -> torch.Tensor:
    """Ban stop tokens (incl. EOS) for rows that have generated fewer than ``min_tokens``."""
    rows: list[int] = []
    cols: list[int] = []
    for row, (minimum, stop_ids) in min_tokens.items():
        if len(output_token_ids[row]) < minimum:
            rows.extend([row] * len(stop_ids))
            cols.extend(stop_ids)
    if not rows:
        return logits
    return logits.index_put_(_index(rows, cols, logits.device), torch.tensor(_NEG_INF, device=logits.device))


def _index(rows: list[int], cols: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(cols, dtype=torch.int64, device=device),
    )


# --------------------------------------------------------------------------- penalties
# Sparse: each op touches only the logits of the tokens a row has seen ([N, L] gathers and scatters),
# never a dense [N, V] count or mask (at 64 rows of a 49k vocabulary each such pass is 12-25 MB).


def _distinct(token_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's distinct tokens, from ``token_ids`` [N, L] padded with ``vocab_size``: (the ids
    sorted, padding at 0; a mask of each distinct id's first place; how often it occurs there)."""
    ids, _ = token_ids.sort(dim=1)
    valid = ids < vocab_size
    first = valid.clone()
    first[:, 1:] &= ids[:, 1:] != ids[:, :-1]
    # A place's run starts at the last first place at or before it; a run's length is its count.
    place = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    start = torch.where(first, place, 0).cummax(dim=1).values
    counts = torch.zeros_like(ids).scatter_add_(1, start, valid.to(ids.dtype))
    return torch.where(valid, ids, 0), first, counts


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """Push seen tokens toward 'less likely': divide positive logits, multiply the others.

    ``seen`` [N, L]: token ids padded with ``vocab_size`` (repeats allowed). A plain division
    would make negative logits *more* likely, hence the sign split.
    """
    vocab_size = logits.shape[1]
    valid = seen < vocab_size
    # Padding points at the row's first seen token and writes that token's value again, so the
    # scatter's writes to one place all agree (a row with none writes column 0 back unchanged).
    first_seen = seen.min(dim=1, keepdim=True).values
    index = torch.where(valid, seen, torch.where(first_seen < vocab_size, first_seen, 0))
    before = logits.gather(1, index)
    scale = torch.where(valid.any(dim=1, keepdim=True), penalties.unsqueeze(1), 1.0)
    return logits.scatter_(1, index, torch.where(before > 0, before / scale, before * scale))


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties (vLLM/HF semantics).

    Repetition covers tokens seen in the prompt or the output; frequency and presence
    count the output only. Token tensors are [N, L] int64 padded with vocab_size.
    """
    vocab_size = logits.shape[1]
    seen = output_token_ids if prompt_token_ids is None else torch.cat([prompt_token_ids, output_token_ids], dim=1)
    if seen.shape[1]:
        logits = apply_repetition_penalty(logits, seen, repetition_penalties)
    if output_token_ids.shape[1]:
        ids, first, counts = _distinct(output_token_ids, vocab_size)
        # Two adds, as logits - f * count - p would round: only each distinct token's first place adds.
        zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
        logits.scatter_add_(1, ids, torch.where(first, -(frequency_penalties.unsqueeze(1) * counts), zero))
        logits.scatter_add_(1, ids, torch.where(first, -presence_penalties.unsqueeze(1), zero))
    return logits


# --------------------------------------------------------------------------- random-path ops
def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor, eps: float = SAMPLING_EPS) -> torch.Tensor:
    """Divide each row by its temperature; greedy rows (temp ~0) are left as is.

    Greedy rows are resolved by argmax elsewhere; dividing them by 0 would only make NaNs.
    """
    safe = torch.where(temperature < eps, 1.0, temperature)
    return logits.div_(safe.unsqueeze(1))


# Top-k / top-p by selection among each row's highest logits (torch.topk, O(V) a row) rather than
# a sort of the whole vocabulary (~4 ms a row of 49k tokens on CPU, 270 ms at batch 64: longer than
# the model's step). A nucleus needing more than NUCLEUS_CANDIDATES tokens (a nearly flat row) and
# a top-k above a quarter of the vocabulary take the sort.
NUCLEUS_CANDIDATES = 256
TOP_K_SELECTION_SHARE = 4


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask tokens outside each row's top-k and top-p nucleus; keeps at least one token.

    ``top_k`` 0 means off; ties at the k-th value are all kept, as in vLLM. A row's nucleus is
    taken after its top-k: the highest tokens while those ranked above them hold less than
    ``top_p`` of the probability (so at least one). On CPU both are found by selection (see
    ``NUCLEUS_CANDIDATES``); on other devices, where sorting is cheap, by one shared sort.
    """
    if top_k is None and top_p is None:
        return logits
    if logits.device.type != "cpu":
        return _sorted_top_k_top_p(logits, top_k, top_p)
    candidates = None
    if top_k is not None:
        logits, candidates = _mask_top_k(logits, top_k, NUCLEUS_CANDIDATES if top_p is not None else 1)
    if top_p is not None:
        rows = (top_p < 1.0).nonzero().squeeze(1)
        if rows.numel() == logits.shape[0]:  # every row: no gather and scatter back
            return _nucleus(logits, top_p, candidates)
        if rows.numel():
            picked = None if candidates is None else (candidates[0][rows], candidates[1][rows])
            logits[rows] = _nucleus(logits[rows], top_p[rows], picked)
    return logits


def _mask_top_k(
    logits: torch.Tensor, top_k: torch.Tensor, at_least: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(the logits with each row's top-k left, each row's highest ``max(k, at_least)`` values,
    masked the same, and their indices, descending; None where no row has a top-k or the sort
    ran): the nucleus that follows takes its candidates from them instead of a second topk."""
    vocab_size = logits.shape[1]
    k = torch.where(top_k <= 0, vocab_size, top_k).clamp(max=vocab_size).to(torch.int64)
    off = k >= vocab_size
    if bool(off.all()):
        return logits, None
    widest = int(torch.where(off, 1, k).max())
    if widest > vocab_size // TOP_K_SELECTION_SHARE:
        return _sorted_top_k_top_p(logits, top_k, None), None
    values, index = logits.topk(min(vocab_size, max(widest, at_least)), dim=-1)  # descending
    threshold = values.gather(1, (torch.where(off, 1, k) - 1).unsqueeze(1)).masked_fill_(off.unsqueeze(1), _NEG_INF)
    values.masked_fill_(values < threshold, _NEG_INF)
    return mask_below_(logits, threshold.squeeze(1)), (values, index)


def _nucleus(
    logits: torch.Tensor, top_p: torch.Tensor, candidates: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Rows [R, V] with only their nucleus left (a new tensor). ``candidates``: each row's highest
    values (at least ``NUCLEUS_CANDIDATES``, or all) and their indices, descending, when the
    caller has them already."""
    vocab_size = logits.shape[1]
    if candidates is None:
        candidates = logits.topk(min(vocab_size, NUCLEUS_CANDIDATES), dim=-1)
    values, index = candidates
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp_()
    inclusive = probs.cumsum(dim=-1)
    keep = inclusive - probs < top_p.unsqueeze(1)  # what the tokens above hold
    keep[:, 0] = True
    out = torch.full_like(logits, _NEG_INF).scatter_(1, index, values.masked_fill_(~keep, _NEG_INF))
    if values.shape[1] < vocab_size:
        # The next token below the candidates would be kept too: the nucleus reaches past them.
        wider = (inclusive[:, -1] < top_p).nonzero().squeeze(1)
        if wider.numel():
            out[wider] = _sorted_top_k_top_p(logits[wider], None, top_p[wider])
    return out


def _sorted_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Top-k then top-p through one ascending sort of each row."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        sorted_logits = _mask_top_k_sorted(sorted_logits, top_k)
    if top_p is not None:
        sorted_logits = _mask_top_p_sorted(sorted_logits, top_p)
    return logits.scatter_(-1, order, sorted_logits)


def _mask_top_k_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab_size = sorted_logits.shape[1]
    k = torch.where(top_k <= 0, vocab_size, top_k).clamp(max=vocab_size).to(torch.int64)
    # Ascending order: the k-th largest value sits at column V - k.
    threshold = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
    return sorted_logits.masked_fill_(sorted_logits < threshold, _NEG_INF)


def _mask_top_p_sorted(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop the low tail whose total mass is at most 1 - p; the best token always stays.
    drop = cumulative <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False
    return sorted_logits.masked_fill_(drop, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p * max_prob`` of their row. As p_i / p_max =
    exp(l_i - l_max), that is a logit below the row's largest + log(min_p): no softmax over the
    vocabulary (min_p 0: log 0 = -inf, nothing masked)."""
    return mask_below_(logits, logits.amax(dim=-1) + min_p.to(logits.dtype).log())


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row of ``probs`` [N, V] (non-negative weights, any scale); a row with
    no positive weight draws token 0. A seeded row draws only from its own generator, so it gets
    the same token whatever else is in the batch. A token of weight 0 is never drawn.

    On CPU by inverse transform: the first token whose running sum passes ``u * total``, one
    uniform ``u`` per row. The sums are stored in float32 but accumulated in float64 (ATen's
    CPU cumsum), so each is the exact prefix sum rounded once and never decreases: any token's
    probability is exact to 6e-8 of the row's total, as in ``torch.multinomial``. The exponential
    race (argmax of probs / Exp(1) noise) needs V random numbers per row: ``exponential_`` took
    ~1.1 ms per 49k-token row on CPU, 85 ms for a batch of 64, as long as the model's own step.
    Other devices keep the race: it is cheap there, and a float32 cumsum accumulated in float32
    by a parallel scan can step down past a zero-weight token.
    """
    if probs.device.type != "cpu":
        return _exponential_race(probs, generators)
    u = torch.rand(probs.shape[0])
    for row, generator in generators.items():
        u[row] = torch.rand(1, generator=generator)[0]
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the search ends on a token of positive weight even when
    # u * total rounds up to it (past the last such token the running sums stay at the total).
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
    return torch.where(total.squeeze(1) > 0, drawn, 0)


def _exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(probs / E), E ~ Exp(1) per entry: the same distribution with V draws per row."""
    noise = torch.empty_like(probs).exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)
