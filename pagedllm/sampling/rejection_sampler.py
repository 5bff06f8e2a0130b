"""Speculative decoding's verification step: keep a prefix of the drafts, then emit one target token.

Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023). Draft ``x`` at a
position where the target's distribution is ``p`` and the draft's was ``q`` is accepted with
probability ``min(1, p(x) / q(x))``; at the first rejection the emitted token is drawn from
``normalize(max(0, p - q))``. Every emitted token is then distributed exactly as if sampled
from the target alone. Greedy requests accept a draft iff it is the target's argmax.

A deterministic proposer (n-gram) passes ``draft_probs=None``: ``q`` is one-hot at the draft,
so acceptance is ``u < p(x)`` and the residual is ``p`` with ``x`` removed. That is exact for
any rule that picks the draft, which is why a proposer that samples its drafts must pass its
real ``q``: claiming one-hot stays exact but accepts less often than it could.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from pagedllm.sampling.ops import random_sample


@dataclass(frozen=True)
class _Layout:
    """Where each request's draft rows sit in the flat [R] batch (host list + device tensors)."""

    num_draft_tokens: list[int]  # [B] on the host
    counts: torch.Tensor  # [B] the same, on the device
    offsets: torch.Tensor  # [B] first row of each request
    row_request: torch.Tensor  # [R] request of each row

    @classmethod
    def build(cls, num_draft_tokens: list[int], device: torch.device) -> _Layout:
        counts = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)
        starts = list(accumulate(num_draft_tokens, initial=0))[:-1]
        return cls(
            num_draft_tokens=num_draft_tokens,
            counts=counts,
            offsets=torch.tensor(starts, dtype=torch.int64, device=device),
            row_request=torch.repeat_interleave(torch.arange(len(num_draft_tokens), device=device), counts),
        )


def rejection_sample(
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft_tokens: list[int],
    bonus_token_ids: torch.Tensor,
    is_greedy: list[bool],
    generators: dict[int, torch.Generator] | None = None,
) -> list[list[int]]:
    """Per request: its accepted drafts, then the recovered token (first rejection) or the bonus token.

    Args:
        target_probs: [R, V] float32, the target's processed distribution at each draft position.
        target_argmax: [R] int64, argmax of the processed target logits (used by greedy requests).
        draft_token_ids: [R] int64.
        draft_probs: [R, V], the distribution each draft was sampled from; None for a
            deterministic proposer (``q`` one-hot at the draft).
        num_draft_tokens: drafts per request (zeros allowed); request i owns a contiguous run
            of rows, in request order, and the counts sum to R.
        bonus_token_ids: [B] int64, a target sample at the position after each request's last draft.
        is_greedy: per request, temperature 0.
        generators: request index -> its seeded generator. A seeded random request with drafts
            draws its randomness here from it (k uniforms, then one V-sized exponential draw for
            a recovered token), after the caller's bonus draw, in that fixed order.

    Returns:
        B lists of 1..k_i + 1 token ids. Inputs are not modified; one device-to-host copy (the only sync).
    """
    _check_inputs(
        target_probs, target_argmax, draft_token_ids, draft_probs, num_draft_tokens, bonus_token_ids, is_greedy
    )
    device = target_probs.device
    generators = generators or {}
    layout = _Layout.build(num_draft_tokens, device)
    greedy_rows = torch.tensor(is_greedy, dtype=torch.bool, device=device)[layout.row_request]

    uniforms = _uniforms(layout, is_greedy, generators)
    accepted = _accepted(target_probs, target_argmax, draft_token_ids, draft_probs, uniforms, greedy_rows)
    num_accepted = _num_accepted(accepted, layout)
    final = _final_tokens(
        target_probs,
        target_argmax,
        draft_token_ids,
        draft_probs,
        num_accepted,
        layout,
        bonus_token_ids,
        is_greedy,
        generators,
    )
    return _assemble(draft_token_ids, num_accepted, final, num_draft_tokens)


def _check_inputs(
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft_tokens: list[int],
    bonus_token_ids: torch.Tensor,
    is_greedy: list[bool],
) -> None:
    """Shape agreement between the arguments; a mismatch is a caller bug that would otherwise mis-slice rows."""
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be [R, V], got shape {tuple(target_probs.shape)}")
    num_rows = target_probs.shape[0]
    if tuple(target_argmax.shape) != (num_rows,) or tuple(draft_token_ids.shape) != (num_rows,):
        raise ValueError(
            f"target_argmax and draft_token_ids must be [{num_rows}], got "
            f"{tuple(target_argmax.shape)} and {tuple(draft_token_ids.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(
            f"draft_probs must match target_probs {tuple(target_probs.shape)}, got {tuple(draft_probs.shape)}"
        )
    if any(k < 0 for k in num_draft_tokens) or sum(num_draft_tokens) != num_rows:
        raise ValueError(f"num_draft_tokens must be >= 0 and sum to {num_rows} rows, got {num_draft_tokens}")
    if not len(num_draft_tokens) == len(is_greedy) == bonus_token_ids.shape[0]:
        raise ValueError(
            f"num_draft_tokens ({len(num_draft_tokens)}), is_greedy ({len(is_greedy)}) and "
            f"bonus_token_ids ({bonus_token_ids.shape[0]}) must have one entry per request"
        )


def _uniforms(layout: _Layout, is_greedy: list[bool], generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One U[0, 1) per row; a seeded random request's rows come from its own generator."""
    counts = layout.num_draft_tokens
    uniforms = torch.rand(sum(counts), device=layout.counts.device)
    starts = list(accumulate(counts, initial=0))
    for request, generator in generators.items():
        # Greedy requests never look at u: leave their generators untouched.
        if counts[request] and not is_greedy[request]:
            uniforms[starts[request] : starts[request + 1]] = torch.rand(
                counts[request], generator=generator, device=uniforms.device
            )
    return uniforms


def _accepted(
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    greedy_rows: torch.Tensor,
) -> torch.Tensor:
    """[R] bool: whether each draft passes its own test, ignoring earlier rejections."""
    draft_index = draft_token_ids.unsqueeze(1)
    target_p = target_probs.gather(1, draft_index).squeeze(1)
    draft_q = 1.0 if draft_probs is None else draft_probs.gather(1, draft_index).squeeze(1)
    # u < p/q written without the division; strict so a token with p(x) == 0 is never
    # accepted, not even when u comes out exactly 0.
    random_ok = uniforms * draft_q < target_p
    return torch.where(greedy_rows, draft_token_ids == target_argmax, random_ok)


def _num_accepted(accepted: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """[B]: index of each request's first rejected draft, or its draft count if none was rejected."""
    position = torch.arange(accepted.shape[0], device=accepted.device) - layout.offsets[layout.row_request]
    # Accepted rows vote for "all accepted"; the per-request minimum is the first rejection.
    vote = torch.where(accepted, layout.counts[layout.row_request], position)
    return layout.counts.clone().scatter_reduce_(0, layout.row_request, vote, reduce="amin", include_self=True)


def _final_tokens(
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_accepted: torch.Tensor,
    layout: _Layout,
    bonus_token_ids: torch.Tensor,
    is_greedy: list[bool],
    generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """[B]: the token emitted after the accepted drafts (argmax or recovered at a rejection, else bonus)."""
    if target_probs.shape[0] == 0:
        return bonus_token_ids.clone()
    rejected = num_accepted < layout.counts
    # Row of the first rejection; requests without one are clamped onto a valid row and ignored.
    rows = (layout.offsets + num_accepted).clamp(max=target_probs.shape[0] - 1)
    final = torch.where(rejected, target_argmax[rows], bonus_token_ids)
    # Only random requests with drafts can need a recovered token. That is known on the host, so
    # whether they were rejected can stay on the device (no sync); greedy requests cost nothing.
    candidates = [i for i, (k, greedy) in enumerate(zip(layout.num_draft_tokens, is_greedy)) if k and not greedy]
    if not candidates:
        return final
    index = torch.tensor(candidates, dtype=torch.int64, device=final.device)
    local_generators = {j: generators[i] for j, i in enumerate(candidates) if i in generators}
    recovered = _recover(target_probs, draft_probs, draft_token_ids, rows[index], local_generators)
    final[index] = torch.where(rejected[index], recovered, final[index])
    return final


def _recover(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    rows: torch.Tensor,
    generators: dict[int, torch.Generator],
) -> torch.Tensor:
    """One draw per row of ``rows`` from normalize(max(0, p - q)), or from p where that residual is all zero.

    The residual is all zero only when p == q, where a rejection has probability zero; the
    fallback keeps a float-rounding rejection from emitting an arbitrary token.
    """
    target = target_probs.index_select(0, rows)
    if draft_probs is None:
        residual = target.scatter(1, draft_token_ids.index_select(0, rows).unsqueeze(1), 0.0)
    else:
        residual = (target - draft_probs.index_select(0, rows)).clamp_(min=0.0)
    empty = residual.sum(dim=1, keepdim=True) <= 0.0
    # No normalisation needed: the draw scales its uniform number by each row's total.
    return random_sample(torch.where(empty, target, residual), generators)


def _assemble(
    draft_token_ids: torch.Tensor,
    num_accepted: torch.Tensor,
    final: torch.Tensor,
    num_draft_tokens: list[int],
) -> list[list[int]]:
    """Move everything to the host in one transfer and cut it into per-request lists."""
    host = torch.cat([draft_token_ids, num_accepted, final]).tolist()
    num_rows, num_requests = draft_token_ids.shape[0], len(num_draft_tokens)
    drafts = host[:num_rows]
    accepted = host[num_rows : num_rows + num_requests]
    finals = host[num_rows + num_requests :]
    starts = accumulate(num_draft_tokens, initial=0)
    return [drafts[start : start + n] + [token] for start, n, token in zip(starts, accepted, finals)]
