"""Per-step sampling metadata: everything the Sampler needs, as batch tensors.

The worker's persistent input batch builds one ``SamplingMetadata`` for its rows and reuses
it for as long as those rows stay the same; a step that samples only some rows, or several
rows per request (speculative decoding), takes ``select(rows)`` of it. The per-row output
token lists are the request states' own live lists, so a reused metadata sees every new token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class SamplingMetadata:
    """Batch-level sampling inputs for one step; row i describes the i-th sampled request."""

    temperature: torch.Tensor | None  # [N] float32; 0.0 = greedy row. None when all greedy.
    # Per row, on the host: temperature < SAMPLING_EPS (the one definition of greedy).
    greedy: list[bool]
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [N] float32; None if no row uses top-p (< 1)
    top_k: torch.Tensor | None  # [N] int64, 0 = off for that row; None if no row uses it
    min_p: torch.Tensor | None  # [N] float32; None if no row uses it
    generators: dict[int, torch.Generator]  # row -> generator of a seeded request
    max_num_logprobs: int | None  # None: no row wants logprobs; else max k over rows
    no_penalties: bool
    prompt_token_ids: torch.Tensor | None  # [N, max_prompt_len] int64, padded with vocab_size
    output_token_ids: list[list[int]]  # per row, tokens generated before this step (the caller's lists)
    presence_penalties: torch.Tensor  # [N] float32
    frequency_penalties: torch.Tensor  # [N] float32
    repetition_penalties: torch.Tensor  # [N] float32
    min_tokens: dict[int, tuple[int, set[int]]]  # row -> (min_tokens, stop ids incl. EOS)
    logit_bias: list[dict[int, float] | None]  # per row
    allowed_token_ids_mask: torch.Tensor | None  # [N, V] bool, True = NOT allowed
    # row -> token sequences of its bad words (a sequence's last token is banned where the rest
    # ends the row's output); rows without bad words are absent.
    bad_words_token_ids: dict[int, list[list[int]]]

    @property
    def num_rows(self) -> int:
        return len(self.output_token_ids)

    @property
    def has_logit_processing(self) -> bool:
        """Whether any row's logits change before greedy argmax: an allowed-token mask, bad words,
        a bias, min-tokens not yet reached or a penalty."""
        return (
            self.allowed_token_ids_mask is not None
            or bool(self.bad_words_token_ids)
            or any(b is not None for b in self.logit_bias)
            or not self.no_penalties
            or any(len(self.output_token_ids[row]) < minimum for row, (minimum, _) in self.min_tokens.items())
        )

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        generators: dict[int, torch.Generator] | None = None,
        eos_token_id: int | None = None,
    ) -> SamplingMetadata:
        """Build metadata from one ``SamplingParams`` per row.

        ``generators`` maps row -> the request's own generator; it is passed in rather than
        created here because it must persist across steps. ``output_token_ids`` are kept by
        reference (not copied): a caller that appends to them updates the metadata too. ``eos_token_id`` is added to the
        min-tokens stop set unless the request sets ``ignore_eos``.
        """
        temps = [p.temperature for p in params]
        greedy = [t < SAMPLING_EPS for t in temps]
        all_greedy = all(greedy)
        no_penalties = all(_no_penalty(p) for p in params)
        return cls(
            temperature=None if all_greedy else _f32(temps, device),
            greedy=greedy,
            all_greedy=all_greedy,
            all_random=not any(greedy),
            top_p=_optional([p.top_p for p in params], 1.0, torch.float32, device),
            top_k=_optional([p.top_k for p in params], 0, torch.int64, device),
            min_p=_optional([p.min_p for p in params], 0.0, torch.float32, device),
            generators=dict(generators or {}),
            max_num_logprobs=_max_logprobs(params),
            no_penalties=no_penalties,
            prompt_token_ids=None if no_penalties else pad_token_ids(prompt_token_ids, vocab_size, device),
            output_token_ids=list(output_token_ids),
            presence_penalties=_f32([p.presence_penalty for p in params], device),
            frequency_penalties=_f32([p.frequency_penalty for p in params], device),
            repetition_penalties=_f32([p.repetition_penalty for p in params], device),
            min_tokens=_min_tokens(params, eos_token_id),
            logit_bias=[p.logit_bias or None for p in params],
            allowed_token_ids_mask=_allowed_mask(params, vocab_size, device),
            bad_words_token_ids={row: p.bad_words_token_ids for row, p in enumerate(params) if p.bad_words_token_ids},
        )

    def select(self, rows: list[int]) -> SamplingMetadata:
        """The metadata of ``rows`` (indices into this one, repeats allowed), in that order."""
        index: torch.Tensor | None = None

        def take(t: torch.Tensor) -> torch.Tensor:
            nonlocal index
            if index is None or index.device != t.device:
                index = torch.tensor(rows, dtype=torch.int64, device=t.device)
            return t.index_select(0, index)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else take(t)

        all_greedy, all_random = self.all_greedy or not rows, self.all_random or not rows
        if all_greedy or all_random:
            greedy = [all_greedy] * len(rows)
        else:  # a mixed batch: the chosen rows may all be one kind
            greedy = [self.greedy[r] for r in rows]
            all_greedy, all_random = all(greedy), not any(greedy)
        return SamplingMetadata(
            temperature=None if all_greedy else pick(self.temperature),
            greedy=greedy,
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=pick(self.top_p),
            top_k=pick(self.top_k),
            min_p=pick(self.min_p),
            generators={new: self.generators[old] for new, old in enumerate(rows) if old in self.generators},
            max_num_logprobs=self.max_num_logprobs,
            no_penalties=self.no_penalties,
            prompt_token_ids=pick(self.prompt_token_ids),
            output_token_ids=[self.output_token_ids[r] for r in rows],
            presence_penalties=take(self.presence_penalties),
            frequency_penalties=take(self.frequency_penalties),
            repetition_penalties=take(self.repetition_penalties),
            min_tokens={new: self.min_tokens[old] for new, old in enumerate(rows) if old in self.min_tokens},
            logit_bias=[self.logit_bias[r] for r in rows],
            allowed_token_ids_mask=pick(self.allowed_token_ids_mask),
            bad_words_token_ids={
                new: self.bad_words_token_ids[old] for new, old in enumerate(rows) if old in self.bad_words_token_ids
            },
        )


def pad_token_ids(token_ids: list[list[int]], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Stack ragged token lists into [N, max_len] int64, padded with ``vocab_size``.

    The pad id is one past the vocabulary so the penalty ops can scatter it into an
    extra column and drop it, instead of masking.
    """
    width = max((len(t) for t in token_ids), default=0)
    out = torch.full((len(token_ids), width), vocab_size, dtype=torch.int64)
    for row, ids in enumerate(token_ids):
        out[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out.to(device)


def _f32(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _optional(values: list, neutral: float, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
    """A [N] tensor of ``values``, or None when every row has the neutral (disabled) value."""
    if all(v == neutral for v in values):
        return None
    return torch.tensor(values, dtype=dtype, device=device)


def _no_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0


def _max_logprobs(params: list[SamplingParams]) -> int | None:
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    return max(wanted) if wanted else None


def _min_tokens(params: list[SamplingParams], eos_token_id: int | None) -> dict[int, tuple[int, set[int]]]:
    out: dict[int, tuple[int, set[int]]] = {}
    for row, p in enumerate(params):
        stops = set(p.all_stop_token_ids)
        if eos_token_id is not None and not p.ignore_eos:
            stops.add(eos_token_id)
        if p.min_tokens > 0 and stops:
            out[row] = (p.min_tokens, stops)
    return out


def _allowed_mask(params: list[SamplingParams], vocab_size: int, device: torch.device | str) -> torch.Tensor | None:
    """[N, V] bool with True on tokens a row may NOT sample; None when no row restricts."""
    if all(p.allowed_token_ids is None for p in params):
        return None
    mask = torch.zeros((len(params), vocab_size), dtype=torch.bool)
    for row, p in enumerate(params):
        if p.allowed_token_ids is not None:
            mask[row] = True
            mask[row, p.allowed_token_ids] = False
    return mask.to(device)
