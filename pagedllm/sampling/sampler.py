"""The Sampler: logits + SamplingMetadata (+ proposals to verify) -> emitted tokens (+ logprobs).

Order (vLLM's): raw logprobs from the unprocessed logits; allowed-token mask, bad words,
logit bias and min-tokens; penalties; greedy argmax; temperature, top-k/top-p, min-p and an
exponential-race draw for random rows; the two merged per row on temperature < SAMPLING_EPS.
A step that verifies proposals (speculative decoding) processes every row the same way, then
the rejection sampler keeps a prefix of each request's proposals and adds one target token; a
draft model draws its proposals through the same chain (``Sampler.draw``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from pagedllm.sampling import ops
from pagedllm.sampling.metadata import SamplingMetadata, pad_token_ids
from pagedllm.sampling.rejection_sampler import rejection_sample
from pagedllm.sampling_params import SAMPLING_EPS


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
class DraftBatch:
    """The proposals a step verifies, grouped per request in batch order (speculative decoding).

    Request i owns ``num_draft_tokens[i] + 1`` consecutive logits rows: its last real token's,
    then one per proposal. Whether a request is greedy, and its generator, come from the
    sampling metadata of those rows.
    """

    num_draft_tokens: list[int]  # per request; 0 = a plain one-token sample
    draft_token_ids: torch.Tensor  # [sum] int64 on the device, flat in request order
    draft_probs: torch.Tensor | None  # [sum, V] what the drafts were drawn from; None = deterministic


@dataclass
class SamplerOutput:
    """One step's draw: what each request emits, and the raw logprobs of each logits row."""

    # Per request: its one sampled token, or (verifying drafts) its accepted proposals and one more.
    token_ids: list[list[int]]
    logprobs_tensors: LogprobsTensors | None
    # [N] the token of each row, on the device; None when verifying drafts (see token_ids).
    sampled_token_ids: torch.Tensor | None = None


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


class Sampler:
    """Owns the sampling chain: allowed-token mask, bad words, logit bias and min-tokens; penalties;
    greedy argmax; temperature, top-k/top-p, min-p and a seeded random draw; rejection
    sampling of proposals. Stateless: seeded requests' generators travel in the metadata.
    """

    def sample(
        self, logits: torch.Tensor, metadata: SamplingMetadata, drafts: DraftBatch | None = None
    ) -> SamplerOutput:
        """Sample ``logits`` [N, V] (one metadata row per logits row), verifying ``drafts`` if given."""
        if drafts is not None:
            return self._verify(logits, metadata, drafts)
        sampled, _ = self.draw(logits, metadata)
        # Queue the logprobs kernels before .tolist() waits for the device (one sync per step).
        logprobs = self._logprobs(logits, metadata, sampled)
        return SamplerOutput([[t] for t in sampled.tolist()], logprobs, sampled)

    def draw(
        self,
        logits: torch.Tensor,
        md: SamplingMetadata,
        keep_probs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([N] one token per row, the [N, V] distribution the random rows drew from when
        ``keep_probs`` and any row is random, else None). A draft model draws its proposals here."""
        if md.all_greedy and not md.has_logit_processing:
            # Nothing to change in the logits: argmax them as they are (the float32 copy below
            # is 25 MB at 128 rows x 49k vocabulary, a few ms per step on CPU).
            return ops.greedy(logits), None
        processed = self.process(logits, md)
        if md.all_greedy:  # checked first: an empty batch is both all-greedy and all-random
            return ops.greedy(processed), None
        greedy = None if md.all_random else ops.greedy(processed)
        probs = self.probs(processed, md)
        drawn = ops.random_sample(probs, md.generators)
        if greedy is not None:
            assert md.temperature is not None, "None only when every row is greedy (returned above)"
            drawn = torch.where(md.temperature < SAMPLING_EPS, greedy, drawn)
        return drawn, probs if keep_probs else None

    @classmethod
    def process(cls, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """A float32 copy of ``logits`` with the constraints and penalties applied (the raw
        logits stay untouched: they feed the logprobs)."""
        processed = logits.to(torch.float32, copy=True)
        return cls.apply_penalties(cls.apply_constraints(processed, md), md)

    @staticmethod
    def apply_constraints(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Hard constraints that also bind greedy rows: allowed ids, bad words, bias, min-tokens."""
        logits = ops.apply_allowed_token_mask(logits, md.allowed_token_ids_mask)
        logits = ops.apply_bad_words(logits, md.output_token_ids, md.bad_words_token_ids)
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

    @staticmethod
    def probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows draw from: temperature, top-k/top-p, min-p, softmax.
        Greedy rows come out at temperature 1 (unused). Writes into ``logits``."""
        assert md.temperature is not None, "called only when some row is random"
        logits = ops.apply_temperature(logits, md.temperature, SAMPLING_EPS)
        logits = ops.apply_top_k_top_p(logits, md.top_k, md.top_p)
        if md.min_p is not None:
            logits = ops.apply_min_p(logits, md.min_p)
        return logits.softmax(dim=-1, dtype=torch.float32)

    @staticmethod
    def _logprobs(logits: torch.Tensor, md: SamplingMetadata, token_ids: torch.Tensor) -> LogprobsTensors | None:
        if md.max_num_logprobs is None:
            return None
        # vLLM's default "raw_logprobs": what the model said, before any processing.
        return compute_logprobs_topk(logits, md.max_num_logprobs, token_ids)

    def _verify(self, logits: torch.Tensor, md: SamplingMetadata, drafts: DraftBatch) -> SamplerOutput:
        """Per request: its accepted proposals + one sampled token (the rejection sampler keeps the
        longest acceptable prefix, so the output follows the target's distribution; token for token
        under greedy). Every row is processed as a plain sample's would be."""
        processed = self.process(logits, md)
        argmax = ops.greedy(processed)
        last_rows = [end - 1 for end in accumulate(k + 1 for k in drafts.num_draft_tokens)]
        last = torch.tensor(last_rows, dtype=torch.int64, device=logits.device)
        is_draft_row = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        is_draft_row[last] = False
        # Per request, from its last row: greedy or not, and its generator (a seeded request's).
        is_greedy = [md.greedy[r] for r in last_rows]
        generators = {i: md.generators[r] for i, r in enumerate(last_rows) if r in md.generators}
        target_probs, bonus = self._targets_and_bonus(processed, md, argmax, last, is_draft_row, is_greedy, generators)
        emitted = rejection_sample(
            target_probs,
            argmax[is_draft_row],
            drafts.draft_token_ids,
            drafts.draft_probs,
            drafts.num_draft_tokens,
            bonus,
            is_greedy,
            generators,
        )
        logprobs = None
        if md.max_num_logprobs is not None:
            logprobs = compute_logprobs_topk(
                logits, md.max_num_logprobs, _emitted_per_row(emitted, drafts.num_draft_tokens, logits.device)
            )
        return SamplerOutput(emitted, logprobs)

    def _targets_and_bonus(
        self,
        processed: torch.Tensor,
        md: SamplingMetadata,
        argmax: torch.Tensor,
        last: torch.Tensor,
        is_draft_row: torch.Tensor,
        is_greedy: list[bool],
        generators: dict[int, torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the target's distribution at each proposal's row, each request's bonus token: a sample
        at its last row). The bonus draw comes first, then the rejection sampler's (seeded order)."""
        if md.all_greedy:
            # Greedy rows never read the target probabilities; skip the softmax over the vocabulary.
            return processed[is_draft_row], argmax[last]
        probs = self.probs(processed, md)
        drawn = ops.random_sample(probs[last], generators)
        return probs[is_draft_row], torch.where(torch.tensor(is_greedy, device=probs.device), argmax[last], drawn)


def _emitted_per_row(emitted: list[list[int]], num_draft_tokens: list[int], device: torch.device) -> torch.Tensor:
    """Row j of a request is scored against its j-th emitted token (rows past the end get a
    placeholder; the runner trims them)."""
    rows = []
    for tokens, k in zip(emitted, num_draft_tokens):
        rows.extend(tokens + [0] * (k + 1 - len(tokens)))
    return torch.tensor(rows, dtype=torch.int64, device=device)
