"""Beam search data types and scoring (torch-free), vLLM's names and rule.

Beam search runs on top of the engine (``LLM.beam_search`` offline, ``beam_search_driver`` in
the server): each step every live beam is submitted as a request for one token with
``logprobs=2 * beam_width``, and the prefix cache makes the beams share the KV blocks of their
common prefix by reference count. This module holds the per-prompt search state, the rule that
turns one step's logprobs into the next beams, and the step loop's bookkeeping both drivers
share (:class:`BeamSearch`: live beams to step prompts, step outputs to the next beams); it
never calls an engine.

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams


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


# ---------------------------------------------------------------------------------- the step loop
class BeamSearch:
    """The engine-facing bookkeeping of one search over several prompts, shared by the offline
    driver (``LLM``) and the server's (``entrypoints.beam_search_driver``): each step
    :meth:`steps` yields the live beams as one-token prompts (``step_params``), the driver runs
    them on its engine and hands the outputs, in the same order, to :meth:`advance`."""

    def __init__(
        self,
        prompts_token_ids: list[list[int]],
        params: BeamSearchParams,
        eos_token_id: int | None,
        max_model_len: int,
        salts: list[str | None] | None = None,
    ) -> None:
        self.params = params
        self.max_model_len = max_model_len
        self.instances = [BeamSearchInstance(ids, params, eos_token_id) for ids in prompts_token_ids]
        self.salts = salts if salts is not None else [None] * len(self.instances)
        self.step_params = SamplingParams(
            n=1, max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width, detokenize=False
        )
        self._live: list[tuple[BeamSearchInstance, BeamSearchSequence, str | None]] = []

    def steps(self) -> Iterator[list[dict[str, Any]]]:
        """The prompts of each step (one per live beam) until ``max_tokens`` steps have run or no
        beam is left to extend; the driver calls :meth:`advance` before asking for the next."""
        for _ in range(self.params.max_tokens):
            self._live = []
            for inst, salt in zip(self.instances, self.salts):
                inst.finish_at_length_limit(self.max_model_len)
                self._live.extend((inst, beam, salt) for beam in inst.beams)
            if not self._live:
                return
            yield [_beam_prompt(beam, salt) for _, beam, salt in self._live]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Expand every live beam by its step output's logprobs, then keep the best of each prompt."""
        for (inst, beam, _), output in zip(self._live, outputs, strict=True):
            step_logprobs = output.outputs[0].logprobs
            assert step_logprobs, "a one-token request with logprobs reports one logprobs row"
            inst.expand(beam, step_logprobs[0])
        for inst in self.instances:
            inst.prune()

    def best(self) -> list[list[BeamSearchSequence]]:
        """Per prompt, its best ``beam_width`` sequences, best first."""
        return [inst.best() for inst in self.instances]


def beam_search_params(sp: SamplingParams, max_model_len: int, temperature: float = 0.0) -> BeamSearchParams:
    """The search a ``use_beam_search`` SamplingParams asks for (width ``sp.beam_width``);
    ``max_tokens`` None: until the model's length limit."""
    return BeamSearchParams(
        beam_width=sp.beam_width,
        max_tokens=sp.max_tokens or max_model_len,
        ignore_eos=sp.ignore_eos,
        temperature=temperature,
        length_penalty=sp.length_penalty,
        include_stop_str_in_output=sp.include_stop_str_in_output,
    )


def check_beam_width(beam_width: int, max_logprobs: int, name: str, how_to_raise: str) -> None:
    """ValueError when a search of this width needs more logprobs per step (2 * width) than the
    engine's ``max_logprobs`` cap (-1: none); ``name``: the width as the caller spells it,
    ``how_to_raise``: how to start an engine with a larger cap."""
    if 0 <= max_logprobs < 2 * beam_width:
        raise ValueError(
            f"{name}={beam_width}: a beam search of width {beam_width} needs 2 * {beam_width} logprobs per "
            f"step, more than this engine's max_logprobs={max_logprobs}; use {name} <= {max_logprobs // 2} "
            f"or start the engine with a larger max_logprobs ({how_to_raise}; -1 for no cap)"
        )


def decode_beams(
    tokenizer: Any, beams: list[BeamSearchSequence], include_stop: bool, skip_special_tokens: bool = True
) -> None:
    """Fill in each beam's ``text``, the generated part; an EOS that ended a beam is spelled out
    only with include_stop (it is a special token, which skip_special_tokens would otherwise drop)."""
    for beam in beams:
        ids = beam.output_token_ids
        stopped = beam.finish_reason == "stop"
        beam.text = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=skip_special_tokens)
        if stopped and include_stop:
            beam.text += tokenizer.decode(ids[-1:], skip_special_tokens=False)


def beams_output(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    beams: list[BeamSearchSequence],
    sp: SamplingParams,
    tokenizer: Any,
    num_cached_tokens: int = 0,
) -> RequestOutput:
    """One prompt's finished output: its best ``sp.n`` beams, decoded, as the choices."""
    beams = beams[: sp.n]
    decode_beams(tokenizer, beams, sp.include_stop_str_in_output, sp.skip_special_tokens)
    completions = [_completion(i, beam, sp) for i, beam in enumerate(beams)]
    return RequestOutput(
        request_id, prompt, prompt_token_ids, None, completions, finished=True, num_cached_tokens=num_cached_tokens
    )


def _beam_prompt(beam: BeamSearchSequence, salt: str | None) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": beam.tokens}
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


def _completion(index: int, beam: BeamSearchSequence, sp: SamplingParams) -> CompletionOutput:
    logprobs = None
    if sp.logprobs is not None:
        logprobs = [_trim_logprobs(row, token, sp.logprobs) for row, token in zip(beam.logprobs, beam.output_token_ids)]
    return CompletionOutput(
        index=index,
        text=beam.text or "",
        token_ids=beam.output_token_ids,
        cumulative_logprob=beam.cum_logprob,
        logprobs=logprobs,
        finish_reason=beam.finish_reason,
        stop_reason=beam.stop_reason,
    )


def _trim_logprobs(row: dict[int, Logprob], token: int, k: int) -> dict[int, Logprob]:
    """The step's candidates cut to what the request asked for: the chosen token and the top k."""
    return {t: lp for t, lp in row.items() if t == token or k < 0 or (lp.rank is not None and lp.rank <= k)}
