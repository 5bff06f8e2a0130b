"""Proposers: who guesses a request's next tokens after each step (worker side).

The contract is plain data: a proposer receives ``ProposerInputs`` (the step that just ran, as
explicit arrays and tensors) and returns ``Proposals``; it never sees the model runner. The
scheduler only ever sees token lists, so a new kind of proposer (an EAGLE or Medusa head reading
``ProposerInputs.hidden_states``) plugs in here without touching either. ``factory.py`` picks
the implementation (``ngram.py``, ``draft_model.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: this module and ngram.py stay importable without torch
    import numpy as np
    import torch

    from pagedllm.sampling.metadata import SamplingMetadata
    from pagedllm.sampling_params import SamplingParams


@dataclass
class ProposerInputs:
    """The step that just ran, after sampling. Batch rows are the step's requests; arrays are
    host (numpy) views of the persistent batch, valid until the next step changes it."""

    req_ids: list[str]  # per batch row
    token_ids: np.ndarray  # [rows, width] each row's tokens so far (prompt + output, this step's included)
    num_tokens: np.ndarray  # [rows] valid tokens per row of ``token_ids``
    starts: np.ndarray  # [rows] tokens computed before this step (its first position)
    num_scheduled: np.ndarray  # [rows] tokens the target ran this step (proposals verified included)
    block_table: np.ndarray  # [rows, blocks] the KV blocks (shared by every model), 0-padded
    block_size: int
    hidden_states: torch.Tensor  # [T, hidden] the target's last hidden states, T = num_scheduled.sum()
    sample_batch_rows: np.ndarray  # [S] batch rows of the requests that sampled, in order
    emitted: list[list[int]]  # per sampling request: the tokens it emitted this step
    max_proposals: np.ndarray  # [S] how many proposals each sampling request may get (0: none)
    sampling: SamplingMetadata | None  # one row per batch row (``select`` the ones needed); None: S = 0


@dataclass
class Proposals:
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> [k, V]: the distribution each proposal was drawn from. Absent for deterministic
    # proposals (n-gram, greedy), which the verifier treats as one-hot.
    probs: dict[str, torch.Tensor] = field(default_factory=dict)


class Proposer(Protocol):
    """Guesses up to ``inputs.max_proposals[i]`` next tokens for each request that sampled."""

    @property
    def models(self) -> list[torch.nn.Module]:
        """The models it runs: their attention layers get KV caches like the target's."""
        ...

    def propose(self, inputs: ProposerInputs) -> Proposals: ...


def speculation_room(
    params: SamplingParams, num_tokens: int, num_output_tokens: int, k: int, max_model_len: int
) -> int:
    """How many proposals are worth verifying for a request next step (0: none).

    Proposals must stay inside max_model_len and max_tokens (the step always adds one sampled
    token after them), and are only made where every verified position samples from the same
    processed distribution: penalties, pending min_tokens, grammars and bad words of several
    tokens depend on the tokens before each position, so those requests decode one token at a
    time, exactly as without speculation.
    """
    if (
        params.structured_outputs is not None
        or params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or num_output_tokens < params.min_tokens
        or any(len(sequence) > 1 for sequence in params.bad_words_token_ids)
    ):
        return 0
    # The step emits up to room + 1 tokens; a draft model then runs on the last of them, so its
    # position (len + room) must stay below max_model_len.
    room = min(k, max_model_len - num_tokens - 1)
    if params.max_tokens is not None:
        room = min(room, params.max_tokens - num_output_tokens - 1)
    return max(room, 0)
