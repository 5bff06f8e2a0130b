"""Sampling a step that verifies proposals (speculative decoding).

A request with k proposals has k + 1 logits rows: its last real token's and one per proposal.
Every row is processed exactly as the plain Sampler would (constraints, penalties, temperature,
top-k/top-p, min-p), the last row of each request yields the bonus token, and the rejection
sampler keeps the longest acceptable prefix of the proposals, so the output follows the target
model's distribution (token for token under greedy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sampling import ops
from pagedllm.sampling.metadata import SamplingMetadata
from pagedllm.sampling.rejection_sampler import rejection_sample
from pagedllm.sampling.sampler import LogprobsTensors, Sampler, compute_logprobs_topk


@dataclass
class DraftBatch:
    """The proposals under verification, grouped per request in batch order."""

    num_draft_tokens: list[int]  # per request; 0 = a plain one-token sample
    draft_token_ids: list[int]  # flat
    draft_probs: torch.Tensor | None  # [sum, V] what the drafts were drawn from; None = deterministic
    is_greedy: list[bool]  # per request
    generators: dict[int, torch.Generator]  # request index -> seeded generator


def sample_with_drafts(sampler: Sampler, logits: torch.Tensor, md: SamplingMetadata,
                       drafts: DraftBatch) -> tuple[list[list[int]], LogprobsTensors | None]:
    """Per request: accepted proposals + one sampled token; plus the target's logprobs per row.

    ``md`` has one row per logits row (a request's parameters repeated over its rows).
    """
    processed = logits.to(torch.float32, copy=True)
    processed = sampler.apply_penalties(sampler.apply_constraints(processed, md), md)
    argmax = processed.argmax(dim=-1)
    last = _last_rows(drafts.num_draft_tokens, logits.device)
    is_draft_row = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    is_draft_row[last] = False
    if md.all_greedy:
        bonus = argmax[last]
        # Greedy rows never read the target probabilities; skip the softmax over the vocabulary.
        target_probs = processed[is_draft_row]
    else:
        probs = sampler.processed_probs(processed, md)
        target_probs = probs[is_draft_row]
        greedy = torch.tensor(drafts.is_greedy, device=logits.device)
        drawn = ops.random_sample(probs[last].clone(), drafts.generators)
        bonus = torch.where(greedy, argmax[last], drawn)
    emitted = rejection_sample(
        target_probs, argmax[is_draft_row], torch.tensor(drafts.draft_token_ids, dtype=torch.int64,
                                                         device=logits.device),
        drafts.draft_probs, drafts.num_draft_tokens, bonus, drafts.is_greedy, drafts.generators)
    logprobs = None
    if md.max_num_logprobs is not None:
        logprobs = compute_logprobs_topk(logits, md.max_num_logprobs, _emitted_per_row(emitted, drafts, logits))
    return emitted, logprobs


def _last_rows(num_draft_tokens: list[int], device: torch.device) -> torch.Tensor:
    counts = torch.tensor(num_draft_tokens, dtype=torch.int64) + 1
    return (counts.cumsum(0) - 1).to(device)


def _emitted_per_row(emitted: list[list[int]], drafts: DraftBatch, logits: torch.Tensor) -> torch.Tensor:
    """Row j of a request is scored against its j-th emitted token (rows past the end get a
    placeholder; the runner trims them)."""
    rows = []
    for tokens, k in zip(emitted, drafts.num_draft_tokens):
        rows.extend(tokens + [0] * (k + 1 - len(tokens)))
    return torch.tensor(rows, dtype=torch.int64, device=logits.device)
