"""The Sampler: logits + SamplingMetadata -> sampled token ids (+ logprobs).

Order (vLLM's): raw logprobs from the unprocessed logits; allowed-token mask, logit bias
and min-tokens; penalties; greedy argmax; temperature, top-k/top-p, min-p and an
exponential-race draw for random rows; the two merged per row on temperature == 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.sampling import ops
from pagedllm.sampling.metadata import SAMPLING_EPS, SamplingMetadata, pad_token_ids


@dataclass
class LogprobsTensors:
    """Logprobs for a batch of positions: the chosen token first, then the top-k."""

    logprob_token_ids: torch.Tensor  # [N, k+1] int64: column 0 = chosen token, then top-k ids
    logprobs: torch.Tensor  # [N, k+1] float32
    selected_token_ranks: torch.Tensor  # [N] int64, rank of the chosen token (1 = best)

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """Move to CPU Python lists (one device sync for all three)."""
        return (
            self.logprob_token_ids.tolist(),
            self.logprobs.tolist(),
            self.selected_token_ranks.tolist(),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs_tensors: LogprobsTensors | None


def compute_logprobs_topk(logits: torch.Tensor, k: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """Logprob and rank of ``token_ids`` [N] under ``logits`` [N, V], plus the top-``k``.

    Also used for prompt logprobs, with ``token_ids`` the next prompt token of each
    position. Top-k columns are sorted best first; ``k == 0`` returns only column 0.
    """
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat([token_ids, top_ids], dim=1),
        logprobs=torch.cat([chosen, top_logprobs], dim=1),
        selected_token_ranks=ranks,
    )


class Sampler(nn.Module):
    """Samples one token per row; stateless apart from the generators held in metadata."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.all_greedy and not metadata.has_logit_processing:
            # Nothing to change in the logits: argmax them as they are (the float32 copy below
            # is 25 MB at 128 rows x 49k vocabulary, a few ms per step on CPU).
            sampled = logits.argmax(dim=-1)
        else:
            # Own float32 copy: the ops write in place and the raw logits feed the logprobs.
            processed = logits.to(torch.float32, copy=True)
            processed = self.apply_constraints(processed, metadata)
            processed = self.apply_penalties(processed, metadata)
            sampled = self.sample(processed, metadata)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            # vLLM's default "raw_logprobs": what the model said, before any processing.
            logprobs = compute_logprobs_topk(logits, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)

    @staticmethod
    def apply_constraints(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Hard constraints that also bind greedy rows: allowed ids, bias, min-tokens."""
        logits = ops.apply_allowed_token_mask(logits, md.allowed_token_ids_mask)
        logits = ops.apply_logit_bias(logits, md.logit_bias)
        return ops.apply_min_tokens(logits, md.output_token_ids, md.min_tokens)

    @staticmethod
    def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.no_penalties:
            return logits
        vocab_size = logits.shape[1]
        output_ids = pad_token_ids(md.output_token_ids, vocab_size, logits.device)
        return ops.apply_penalties(
            logits,
            md.prompt_token_ids,
            output_ids,
            md.presence_penalties,
            md.frequency_penalties,
            md.repetition_penalties,
        )

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Greedy argmax and/or random draw, merged per row on temperature == 0."""
        if md.all_greedy:  # checked first: an empty batch is both all-greedy and all-random
            return logits.argmax(dim=-1)
        greedy = None if md.all_random else logits.argmax(dim=-1)
        assert md.temperature is not None, "temperature is required unless all rows are greedy"
        random = self.random_sample(logits, md)
        if greedy is None:
            return random
        return torch.where(md.temperature < SAMPLING_EPS, greedy, random)

    @classmethod
    def random_sample(cls, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        return ops.random_sample(cls.processed_probs(logits, md), md.generators)

    @staticmethod
    def processed_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows draw from: temperature, top-k/top-p, min-p, softmax.
        Greedy rows come out at temperature 1 (unused). Writes into ``logits``."""
        logits = ops.apply_temperature(logits, md.temperature, SAMPLING_EPS)
        logits = ops.apply_top_k_top_p(logits, md.top_k, md.top_p)
        if md.min_p is not None:
            logits = ops.apply_min_p(logits, md.min_p)
        return logits.softmax(dim=-1, dtype=torch.float32)
