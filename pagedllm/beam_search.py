"""Beam search data types and scoring (torch-free), vLLM's names and rule.

Beam search runs on top of the engine (``LLM.beam_search``): each step every live beam is
submitted as a request for one token with ``logprobs=2 * beam_width``, and the prefix cache
makes the beams share the KV blocks of their common prefix by reference count. This module
holds the per-prompt search state and the rule that turns one step's logprobs into the next
beams; it knows nothing of the engine.

The rule (vLLM's ``LLM.beam_search``):

* Each live beam expands into every token of its step's logprobs dict (its top ``2 * width``
  plus the sampled token). A candidate ending in EOS (unless ``ignore_eos``) joins the
  completed list; the others compete for the ``width`` live slots by cumulative logprob.
* There is no early stopping: the search runs ``max_tokens`` steps (or until a beam reaches
  the model's length limit), then ranks completed and live beams together by
  :func:`get_beam_search_score` and returns the best ``width``.
* The score is ``cum_logprob / len ** length_penalty`` where ``len`` counts the prompt and the
  generated tokens, less a final EOS (vLLM's, from an older transformers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedllm.outputs import Logprob


@dataclass
class BeamSearchParams:
    """Parameters of ``LLM.beam_search`` (vLLM's names and defaults).

    ``temperature`` only shapes the one token each step samples, which joins the candidates
    beside the top ``2 * beam_width``; at 0 (the default) the search is deterministic.
    ``include_stop_str_in_output``: a sequence that ended on EOS keeps its text in ``text``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` include the prompt (as in vLLM); ``logprobs`` has one dict per
    generated token (the step's candidates). ``text`` (the generated part) and
    ``finish_reason`` are filled in when the search returns it."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None  # the EOS id when finish_reason is "stop"
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """``cum_logprob / len ** length_penalty``; ``len`` counts the prompt, less a final EOS."""
    seq_len = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (seq_len**length_penalty)


class BeamSearchInstance:
    """The search state of one prompt: live beams and completed ones."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_id: int | None) -> None:
        self.params = params
        self.eos_token_id = eos_token_id
        n = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(tokens=list(prompt_token_ids), num_prompt_tokens=n)]
        self.completed: list[BeamSearchSequence] = []
        self._candidates: list[BeamSearchSequence] = []

    def score(self, beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty)

    def finish_at_length_limit(self, max_model_len: int) -> None:
        """Beams that fill the model's context can grow no more: they complete as "length"."""
        for beam in [b for b in self.beams if len(b.tokens) >= max_model_len]:
            beam.finish_reason = "length"
            self.completed.append(beam)
            self.beams.remove(beam)

    def expand(self, beam: BeamSearchSequence, step_logprobs: dict[int, Logprob]) -> None:
        """Add every continuation of ``beam`` in one step's logprobs dict as a candidate."""
        for token_id, logprob in step_logprobs.items():
            child = BeamSearchSequence(
                tokens=beam.tokens + [token_id],
                logprobs=beam.logprobs + [step_logprobs],
                cum_logprob=beam.cum_logprob + logprob.logprob,
                num_prompt_tokens=beam.num_prompt_tokens,
            )
            if token_id == self.eos_token_id and not self.params.ignore_eos:
                child.finish_reason, child.stop_reason = "stop", token_id
                self.completed.append(child)
            else:
                self._candidates.append(child)

    def prune(self) -> None:
        """Keep the ``beam_width`` best candidates as the next live beams (a stable sort, so
        ties keep the order in which beams and their logprobs were listed)."""
        ranked = sorted(self._candidates, key=self.score, reverse=True)
        self.beams, self._candidates = ranked[: self.params.beam_width], []

    def best(self) -> list[BeamSearchSequence]:
        """Completed and live beams together, best ``beam_width`` first; live ones end as "length"."""
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted(self.completed + self.beams, key=self.score, reverse=True)
        return ranked[: self.params.beam_width]
