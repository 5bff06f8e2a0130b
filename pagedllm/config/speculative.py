"""Speculative decoding: ``SpeculativeArgs`` -> frozen ``SpeculativeConfig`` (or None: off).

Accepts vLLM's spellings: ``--speculative-config '{"method": "ngram", ...}'`` and the older
``--speculative-model DIR|[ngram]`` with ``--num-speculative-tokens K``. Every mistake fails at
start-up with a message that says what to change. The proposers are in ``spec_decode/``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.config.choices import SPECULATIVE_METHODS
from pagedllm.config.model import check_architecture
from pagedllm.config.options import option
from pagedllm.gguf_config import is_gguf_file
from pagedllm.hf_config import load_arch_config
from pagedllm.model_arch import ModelArchConfig

MAX_SPECULATIVE_TOKENS = 16  # beyond this the verify forward mostly computes rejected tokens
# n-gram prompt lookup: suffixes of 2..4 tokens are matched, longest first (one side given: the
# other follows it, see _lookup_range).
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "adaptive")
_NGRAM_MODEL = "[ngram]"  # vLLM's old way to ask for prompt lookup through --speculative-model


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses ``num_speculative_tokens`` tokens per step and
    the target model verifies them in the same forward (output unchanged, see spec_decode/)."""

    method: str  # ngram | draft_model
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN  # ngram: shortest suffix matched
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX  # ngram: longest suffix matched (tried first)
    draft_model: str | None = None  # draft_model: a local HF directory
    draft_arch: ModelArchConfig | None = None
    # Fewer proposals (down to none, with probes) for requests whose acceptance does not pay for
    # the verification's step time (spec_decode/adaptive.py); False: always propose up to k.
    adaptive: bool = True

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the verified tokens a step must own: a draft model writes its own KV for
        the bonus token and its k-1 fed-back proposals, up to k positions beyond the target's."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


@dataclass
class SpeculativeArgs:
    """A proposer guesses tokens that the model verifies in one forward."""

    # vLLM's JSON spelling, e.g. {"method": "ngram", "num_speculative_tokens": 4}; a dict or a JSON string.
    speculative_config: dict | str | None = option(
        None,
        'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        f'"prompt_lookup_max": {DEFAULT_PROMPT_LOOKUP_MAX}, "prompt_lookup_min": {DEFAULT_PROMPT_LOOKUP_MIN}}}\' '
        'or \'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\'; output is unchanged, '
        'only faster; "adaptive": false always proposes k tokens (default: fewer, down to none, '
        "for requests whose proposals are rarely accepted)",
        default_help="off",
        metavar="JSON",
    )
    speculative_model: str | None = option(
        None,
        'draft model directory for speculative decoding (same tokenizer), or "[ngram]" for prompt '
        "lookup; use with --num-speculative-tokens",
        default_help="off",
        metavar="DIR",
    )
    num_speculative_tokens: int | None = option(
        None,
        f"tokens proposed per step with --speculative-model (1-{MAX_SPECULATIVE_TOKENS})",
        default_help="off",
        metavar="K",
    )

    def create_speculative_config(self, target: ModelArchConfig, max_model_len: int) -> SpeculativeConfig | None:
        """The validated config, or None when speculation is off."""
        fields = _merge(_parse(self.speculative_config), self.speculative_model, self.num_speculative_tokens)
        if not fields:
            return None
        method = _method(fields)
        k = fields.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS} (e.g. 4), got {k!r}"
            )
        adaptive = fields.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f'"adaptive" must be true or false, got {adaptive!r}')
        if method == "ngram":
            lo, hi = _lookup_range(fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max"))
            return SpeculativeConfig("ngram", k, prompt_lookup_min=lo, prompt_lookup_max=hi, adaptive=adaptive)
        model = fields["model"]
        draft = _draft_arch(model, target, max_model_len)
        return SpeculativeConfig(
            "draft_model", k, draft_model=str(Path(model).expanduser()), draft_arch=draft, adaptive=adaptive
        )


def _parse(spec: dict | str | None) -> dict[str, Any]:
    if spec is None or spec == "":
        return {}
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"speculative_config is not valid JSON ({exc}); example: "
                '\'{"method": "ngram", "num_speculative_tokens": 4}\''
            ) from None
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(_KEYS))
    if unknown:
        raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {', '.join(_KEYS)}")
    return dict(spec)


def _merge(fields: dict[str, Any], model: str | None, k: int | None) -> dict[str, Any]:
    """Fold the separate flags into the JSON fields; the same setting given twice must agree."""
    for key, value in (("model", model), ("num_speculative_tokens", k)):
        if value is None:
            continue
        if key in fields and fields[key] != value:
            raise ValueError(
                f"{key} is given twice with different values ({fields[key]!r} in "
                f"speculative_config, {value!r} as a flag); give it once"
            )
        fields[key] = value
    if fields.get("model") == _NGRAM_MODEL:
        fields.pop("model")
        fields.setdefault("method", "ngram")
    return fields


def _method(fields: dict[str, Any]) -> str:
    method = fields.get("method") or ("draft_model" if fields.get("model") else None)
    if method is None:
        raise ValueError(
            'speculative decoding needs a method: "ngram" (prompt lookup) or "draft_model" '
            'with "model": a local directory of a smaller model with the same tokenizer'
        )
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative method {method!r} does not exist; choose one of {', '.join(SPECULATIVE_METHODS)}"
        )
    if method == "ngram" and fields.get("model"):
        raise ValueError('method "ngram" takes no model; drop "model" or use method "draft_model"')
    if method == "draft_model" and not fields.get("model"):
        raise ValueError('method "draft_model" needs "model": a local directory of the draft model')
    return method


def _lookup_range(lo: int | None, hi: int | None) -> tuple[int, int]:
    """The defaults; one side given, the other follows it so that lo <= hi."""
    if lo is None:
        lo = min(DEFAULT_PROMPT_LOOKUP_MIN, hi) if isinstance(hi, int) else DEFAULT_PROMPT_LOOKUP_MIN
    if hi is None:
        hi = max(DEFAULT_PROMPT_LOOKUP_MAX, lo)
    for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if lo > hi:
        raise ValueError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
    return lo, hi


def _draft_arch(model: str, target: ModelArchConfig, max_model_len: int) -> ModelArchConfig:
    path = Path(model).expanduser()
    if not (path.is_dir() or is_gguf_file(path)):
        raise ValueError(
            f"draft model {model!r} is not a local directory (Hugging Face format) or .gguf file; nothing is downloaded"
        )
    draft = load_arch_config(str(path))
    check_architecture(draft, "draft model architecture")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size}); a draft model must share the target's tokenizer"
        )
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"the draft model supports {draft.max_position_embeddings} positions but max_model_len "
            f"is {max_model_len}; lower max_model_len to at most {draft.max_position_embeddings}"
        )
    return draft
