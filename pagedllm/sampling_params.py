"""Sampling parameters for text generation (torch-free).

Field names, defaults and meanings follow vLLM's ``SamplingParams``. Every value a user
controls is validated here and an out-of-range value raises ``ValueError`` naming the field
and the allowed range.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal

# Temperatures below this are greedy: the one threshold (SamplingParams normalises them to 0 and
# the sampler tests its per-row temperatures against it).
SAMPLING_EPS = 1e-5


class RequestOutputKind(IntEnum):
    """How outputs are reported while a request runs (vLLM's names)."""

    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, any JSON object, a regex, one of several strings or
    an EBNF/GBNF grammar: set exactly one field (vLLM's names). JSON output is compact (no free
    whitespace), so a grammar with bounded strings, numbers and arrays always terminates."""

    json: dict[str, Any] | str | None = None  # a JSON schema, as a dict or its JSON text
    json_object: bool | None = None  # True: any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF/GBNF with a `root` rule

    def __post_init__(self) -> None:
        kinds = [name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_KINDS)}; got {kinds or 'none'}"
            )
        self._verify(kinds[0])

    def _verify(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON ({exc})") from None
            _check(isinstance(value, (dict, bool)), "structured_outputs.json", value, "a JSON schema (an object)")
        elif kind == "json_object":
            _check(value is True, "structured_outputs.json_object", value, "true")
        elif kind == "choice":
            _check(
                isinstance(value, list) and len(value) > 0 and all(isinstance(c, str) for c in value),
                "structured_outputs.choice",
                value,
                "a non-empty list of strings",
            )
        else:
            _check(
                isinstance(value, str) and value.strip() != "",
                f"structured_outputs.{kind}",
                value,
                "a non-empty string",
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        return next(name for name in _STRUCTURED_KINDS if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints get equal keys (the grammar cache's key)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
            # Key order is kept: the output lists properties in the schema's order.
            return kind, json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        if kind == "choice":
            return kind, json.dumps(value, ensure_ascii=False)
        return kind, "" if kind == "json_object" else value


_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class SamplingParams:
    """How to sample the next tokens of one request.

    Beyond vLLM's usual knobs:

    * ``best_of``: None or equal to ``n``. Like vLLM V1 (which refuses ``best_of > 1``; current
      vLLM has dropped the field), this engine returns every sequence it samples and ranks none;
      ``best_of > n`` is refused (ask for ``n`` samples with ``logprobs`` and pick yourself),
      ``best_of == n`` is accepted as the no-op it is. With ``use_beam_search`` it is the beam
      width and may exceed ``n``.
    * ``use_beam_search`` / ``length_penalty`` (vLLM V0's spelling): ``LLM.generate`` runs beam
      search of width ``best_of`` (``n`` when None) and returns the best ``n`` beams; see
      ``pagedllm.beam_search`` for the rule. Beam search is deterministic: temperature, top_p,
      top_k, min_p and seed are ignored, and the options that reshape the distribution or stop
      early (penalties, logit_bias, allowed_token_ids, bad_words, stop, stop_token_ids,
      min_tokens, structured_outputs, prompt_logprobs, truncate_prompt_tokens) are refused. ``use_beam_search=False``
      is the default; ``length_penalty`` other than 1.0 without beam search is refused.
    * ``bad_words``: words that must not be generated. The engine tokenizes each one when the
      request is added, bare and with a leading space (``bad_words_token_ids``); at every step,
      for each such sequence whose all-but-last tokens end the output so far, its last token is
      banned. Only exact token sequences are banned, and only the generated tokens count as the
      prefix (not the prompt), as in vLLM.
    * ``truncate_prompt_tokens``: keep only k prompt tokens (k >= 1), or -1 for as many as fit
      (``max_model_len - max_tokens``, or ``max_model_len - 1`` without ``max_tokens``); None
      keeps the whole prompt. ``truncation_side`` says which end is kept: ``"left"`` (the default,
      vLLM's documented meaning) drops the start and keeps the last k tokens, ``"right"`` keeps
      the first k. Applied when the request is added: outputs report the kept tokens.
    * ``extra_args``: free-form data carried with the request to the sampler (vLLM passes it to
      custom logits processors). The engine itself reads no key of it; it must be msgpack-
      serializable to cross to an engine process.
    * ``logprobs`` / ``prompt_logprobs``: -1 asks for the whole vocabulary at each position (as
      vLLM), which the engine's ``max_logprobs`` must allow (``max_logprobs=-1``).
    * ``logits_processors``: refused. Per-request Python callables do not run in this engine (as
      in vLLM V1); use ``logit_bias``, ``allowed_token_ids``, ``bad_words`` or
      ``structured_outputs`` instead.
    """

    n: int = 1
    best_of: int | None = None  # None or n: see the class docstring
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # None, -1 (as many as fit) or k >= 1
    truncation_side: Literal["left", "right"] = "left"  # left: keep the last k tokens
    extra_args: dict[str, Any] | None = None  # passed through; the engine reads no key
    logits_processors: list[Any] | None = None  # refused unless empty: see the class docstring
    use_beam_search: bool = False  # beam search of width best_of (or n): see the class docstring
    length_penalty: float = 1.0  # beam search only
    # Filled in by the engine, not by users.
    all_stop_token_ids: set[int] = field(default_factory=set)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # token sequences of bad_words

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, (int, str)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _parse_logit_bias(self.logit_bias)
        self.output_kind = RequestOutputKind(self.output_kind)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.bad_words is None:
            self.bad_words = []
        elif isinstance(self.bad_words, (list, tuple)) and all(isinstance(w, str) for w in self.bad_words):
            self.bad_words = list(dict.fromkeys(self.bad_words))  # duplicates dropped, order kept
        self._verify()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the other sampling knobs have no effect, normalise them away.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    # ------------------------------------------------------------------ validation
    def _verify(self) -> None:
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed"):
            _check(not isinstance(getattr(self, name), bool), name, getattr(self, name), "an integer, not a bool")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            _check(
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                name,
                value,
                "a finite number",
            )
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "[-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "[-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "(0, 1]")
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            self.top_k,
            "-1, 0 (disabled) or a positive integer",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "[0, 1]")
        if self.max_tokens is not None:
            _check(
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "max_tokens",
                self.max_tokens,
                "an integer >= 1",
            )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "an integer >= 0"
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(
                    isinstance(value, int) and value >= -1,
                    name,
                    value,
                    "None, -1 (the whole vocabulary) or an integer >= 0",
                )
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", self.seed, "an integer")
        _check(
            self.stop is not None and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            self.stop,
            "non-empty strings",
        )
        _check(
            self.stop_token_ids is not None and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "non-negative integers",
        )
        if self.logit_bias:
            bad = [v for v in self.logit_bias.values() if not -100.0 <= v <= 100.0]
            _check(not bad, "logit_bias", bad, "values in [-100, 100]")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", self.allowed_token_ids, "a non-empty list")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True; use stop_token_ids instead")
        if self.structured_outputs is not None:
            _check(
                isinstance(self.structured_outputs, StructuredOutputsParams),
                "structured_outputs",
                self.structured_outputs,
                "a StructuredOutputsParams (or a dict of its fields)",
            )
            # The grammar decides where the output ends; masking its end tokens would leave nothing.
            _check(self.min_tokens == 0, "min_tokens", self.min_tokens, "0 when structured_outputs is set")
        self._verify_best_of()
        self._verify_request_options()

    def _verify_best_of(self) -> None:
        _check(isinstance(self.use_beam_search, bool), "use_beam_search", self.use_beam_search, "a bool")
        lp = self.length_penalty
        _check(
            isinstance(lp, (int, float)) and not isinstance(lp, bool) and math.isfinite(lp),
            "length_penalty",
            lp,
            "a finite number",
        )
        if self.use_beam_search:
            self._verify_beam_search()
            return
        _check(lp == 1.0, "length_penalty", lp, "1.0 (the default) unless use_beam_search=True")
        if self.best_of is None:
            return
        _check(
            isinstance(self.best_of, int) and not isinstance(self.best_of, bool),
            "best_of",
            self.best_of,
            "None or an integer",
        )
        _check(self.best_of >= self.n, "best_of", self.best_of, f">= n ({self.n})")
        _check(
            self.best_of == self.n,
            "best_of",
            self.best_of,
            f"None or equal to n ({self.n}): like vLLM V1 this engine returns every sample and ranks "
            "none; ask for n samples with logprobs and pick the best yourself",
        )

    def _verify_beam_search(self) -> None:
        if self.best_of is not None:
            _check(
                isinstance(self.best_of, int) and not isinstance(self.best_of, bool) and self.best_of >= self.n,
                "best_of",
                self.best_of,
                f"None or an integer >= n ({self.n}) with use_beam_search (it is the beam width)",
            )
        for name, default in _NOT_WITH_BEAM_SEARCH.items():
            value = getattr(self, name)
            if value not in (default, None) and value not in ([], {}):
                raise ValueError(
                    f"{name} is not supported with use_beam_search; leave it at {default!r}, got {value!r}"
                )

    @property
    def beam_width(self) -> int:
        """The beam width of a use_beam_search request: best_of, or n when best_of is None."""
        return self.best_of if self.best_of is not None else self.n

    def _verify_request_options(self) -> None:
        words = self.bad_words
        _check(
            isinstance(words, list) and all(isinstance(w, str) and w.strip() for w in words),
            "bad_words",
            words,
            "a list of non-empty strings",
        )
        k = self.truncate_prompt_tokens
        if k is not None:
            _check(
                isinstance(k, int) and not isinstance(k, bool) and (k >= 1 or k == -1),
                "truncate_prompt_tokens",
                k,
                "None (no truncation), -1 (as many as fit) or an integer >= 1",
            )
        _check(self.truncation_side in ("left", "right"), "truncation_side", self.truncation_side, "'left' or 'right'")
        if self.extra_args is not None:
            _check(
                isinstance(self.extra_args, dict) and all(isinstance(key, str) for key in self.extra_args),
                "extra_args",
                self.extra_args,
                "None or a dict with string keys",
            )
        if self.logits_processors:
            raise ValueError(
                "logits_processors are not supported: this engine (like vLLM V1) does not run "
                "per-request Python callables; use logit_bias, allowed_token_ids, bad_words or "
                "structured_outputs instead"
            )

    def verify_vocab(self, vocab_size: int) -> None:
        """Check the token ids a user passed against the model's vocabulary."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name) or []
            bad = [t for t in ids if not 0 <= t < vocab_size]
            _check(not bad, name, bad, f"token ids in [0, {vocab_size})")
        bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
        _check(not bad, "logit_bias", bad, f"token ids in [0, {vocab_size})")

    # ------------------------------------------------------------------ helpers
    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def clone(self, **changes: Any) -> SamplingParams:
        new = copy.deepcopy(self)
        for key, value in changes.items():
            setattr(new, key, value)
        new._verify()
        return new


# Options beam search would silently ignore; they must stay at these defaults with use_beam_search.
_NOT_WITH_BEAM_SEARCH: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop": [],
    "stop_token_ids": [],
    "min_tokens": 0,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": [],
    "structured_outputs": None,
    "prompt_logprobs": None,
    "truncate_prompt_tokens": None,
}


def _parse_logit_bias(bias: dict) -> dict[int, float]:
    try:
        return {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError, AttributeError):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}") from None


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
