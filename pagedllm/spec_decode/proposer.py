"""Proposers: who guesses a request's next tokens after each step (worker side).

A proposer sees the step that just ran (the batch, the target's hidden states, the tokens each
request emitted) and returns up to ``num_speculative_tokens`` guesses per request. The
scheduler only ever sees token lists, so a new kind of proposer (an EAGLE or Medusa head reading
``ProposeContext.hidden``) plugs in here without touching it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from pagedllm.config import EngineConfig
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.worker.input_batch import BatchInputs, CachedRequestState

if TYPE_CHECKING:
    from pagedllm.worker.model_runner import ModelRunner


@dataclass
class ProposeContext:
    runner: ModelRunner  # request states, block size, device, sampler, attention backend
    batch: BatchInputs  # the step that just ran
    hidden: torch.Tensor  # the target's last hidden states for that batch
    emitted: dict[str, list[int]]  # tokens each sampling request emitted this step


@dataclass
class Proposals:
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> [k, V]: the distribution each proposal was drawn from. Absent for deterministic
    # proposals (n-gram, greedy), which the verifier treats as one-hot.
    probs: dict[str, torch.Tensor] = field(default_factory=dict)


class Proposer(Protocol):
    def propose(self, ctx: ProposeContext) -> Proposals: ...


def speculation_room(state: CachedRequestState, k: int, max_model_len: int) -> int:
    """How many proposals are worth verifying for this request next step (0: none).

    Proposals must stay inside max_model_len and max_tokens (the step always adds one sampled
    token after them), and are only made where every verified position samples from the same
    processed distribution: penalties, pending min_tokens and grammars depend on the tokens
    before each position, so those requests decode one token at a time, exactly as without
    speculation.
    """
    params = state.sampling_params
    if (params.structured_outputs is not None or params.presence_penalty or params.frequency_penalty
            or params.repetition_penalty != 1.0 or len(state.output_token_ids) < params.min_tokens):
        return 0
    # The step emits up to room + 1 tokens; a draft model then runs on the last of them, so its
    # position (len + room) must stay below max_model_len.
    room = min(k, max_model_len - state.num_tokens - 1)
    if params.max_tokens is not None:
        room = min(room, params.max_tokens - len(state.output_token_ids) - 1)
    return max(room, 0)


class NgramSpecProposer:
    """Prompt lookup: no model, the request's own text predicts its continuation."""

    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative_config
        self.k = spec.num_speculative_tokens
        self.max_model_len = config.model_config.max_model_len
        self.ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def propose(self, ctx: ProposeContext) -> Proposals:
        proposals = Proposals()
        for req_id in ctx.emitted:
            state = ctx.runner.requests[req_id]
            room = speculation_room(state, self.k, self.max_model_len)
            tokens = self.ngram.propose(ctx.runner.input_batch.tokens(req_id), room) if room else []
            if tokens:
                proposals.token_ids[req_id] = list(tokens)
        return proposals


def make_proposer(config: EngineConfig, runner: ModelRunner) -> Proposer | None:
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramSpecProposer(config)
    from pagedllm.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, runner.device, runner.dtype)
