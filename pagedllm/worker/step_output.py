"""Turning a step's sampled tokens and logprobs into the worker's output (per request)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.engine.protocol import LogprobsLists
from pagedllm.sampling.sampler import LogprobsTensors, compute_logprobs_topk
from pagedllm.worker.batch_inputs import BatchInputs
from pagedllm.worker.request_state import CachedRequestState


def split_logprobs(
    tensors: LogprobsTensors,
    states: list[CachedRequestState],
    emitted: list[list[int]],
    rows_per_request: list[int],
    out: dict[str, LogprobsLists],
) -> None:
    """One row per emitted token, trimmed to the request's own number of logprobs."""
    ids, lps, ranks = tensors.tolists()
    row = 0
    for state, tokens, num_rows in zip(states, emitted, rows_per_request):
        k = state.sampling_params.logprobs
        if k is not None:
            rows = range(row, row + len(tokens))
            out[state.req_id] = LogprobsLists(
                [ids[r][: k + 1] for r in rows], [lps[r][: k + 1] for r in rows], [ranks[r] for r in rows]
            )
        row += num_rows


def prompt_logprobs(
    batch: BatchInputs,
    hidden: torch.Tensor,
    states: dict[str, CachedRequestState],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    out: dict[str, LogprobsLists],
) -> None:
    """Logprobs of each next prompt token for the prompt positions computed this step."""
    offset = 0
    for req_id, start, count in zip(batch.req_ids, batch.starts.tolist(), batch.num_scheduled.tolist()):
        state = states[req_id]
        k = state.sampling_params.prompt_logprobs
        first = max(start, state.prompt_logprobs_done)
        end = min(start + count, state.num_prompt_tokens - 1)  # last prompt token predicts nothing
        if k is not None and end > first:
            rows = hidden[offset + first - start : offset + end - start]
            targets = torch.tensor(state.prompt_token_ids[first + 1 : end + 1], device=hidden.device)
            lp = compute_logprobs_topk(compute_logits(rows), k, targets)
            out[req_id] = LogprobsLists(*lp.tolists())
            state.prompt_logprobs_done = end
        offset += count
