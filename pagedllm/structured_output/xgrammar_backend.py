"""The xgrammar backend: JSON schema, regex, choice and EBNF grammars on a byte-level token trie."""

from __future__ import annotations

import json
import os
from typing import Any

import xgrammar as xgr

from pagedllm.structured_output.backend import (
    GrammarCompileError,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    clean_native_error,
)

# Batched bitmask filling pays a thread hand-off; below this many rows a plain loop is faster.
_MIN_BATCH_FILL = 16


# One JSON string character that needs no escape, as a regex: printable ASCII but '"' and '\\',
# then every code point (no surrogates) in ranges of one UTF-8 length each (a range spanning
# lengths also admits overlong byte sequences in xgrammar's regex engine).
_PLAIN_CHAR = "(?:[ !#-\\[\\]-~]|[\\u0080-\\u07FF]|[\\u0800-\\uD7FF]|[\\uE000-\\uFFFF]|[\\u{10000}-\\u{10FFFF}])"


# Calendar dates only (RFC 3339 full-date, years 0001-9999): xgrammar's "date" format takes any
# day 01-31 in any month and the year 0000, so "2023-02-30" could be generated and then fail the
# schema. February 29 only in leap years (divisible by 4, centuries only by 400).
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
# date-time: that date, then xgrammar's own time and offset.
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\\.[0-9]+)?(?:Z|[+\\-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_EXACT_FORMATS = {"date": _DATE, "date-time": f"{_DATE}T{_TIME}"}


def _exact_string_patterns(schema: Any) -> Any:
    """Give strings a ``pattern`` where xgrammar's own rule admits invalid values.

    Length-bounded plain strings: xgrammar's minLength/maxLength rule lets raw control characters
    (invalid JSON) and surrogate byte sequences (which decode to three U+FFFD, breaking the
    length) into the string; the pattern admits no escapes. The ``date`` and ``date-time``
    formats: only real calendar dates (see ``_DATE``)."""
    if isinstance(schema, list):
        return [_exact_string_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _exact_string_patterns(value) for key, value in schema.items()}
    if out.get("type") != "string" or "pattern" in out:
        return out
    if out.get("format") in _EXACT_FORMATS:
        out["pattern"] = f"^{_EXACT_FORMATS[out.pop('format')]}$"
        return out
    bounded = "minLength" in out or "maxLength" in out
    if bounded and not {"format", "enum", "const"} & out.keys():
        low, high = out.get("minLength", 0), out.get("maxLength", "")
        if isinstance(low, int) and (high == "" or isinstance(high, int)):
            out["pattern"] = f"^{_PLAIN_CHAR}{{{low},{high}}}$"
            out.pop("minLength", None)  # the pattern carries the bounds (xgrammar ignores them next
            out.pop("maxLength", None)  # to a pattern, with a warning)
    return out


class XgrammarGrammar(StructuredOutputGrammar):
    __slots__ = ("matcher",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XgrammarBackend(StructuredOutputBackend):
    """``tokenizer``: the HF tokenizer; ``vocab_size``: the model's (logits width)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        threads = max(1, min(8, os.cpu_count() or 1))
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads)
        # "auto", not the core count: extra fill threads fight the model's own threads for the
        # cores (measured on 2 CPU cores: +26% step time with 2 threads, +6% with "auto").
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads="auto")

    def compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        try:
            return self._compile(kind, spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports bad input as RuntimeError
            raise GrammarCompileError(kind, clean_native_error(exc)) from None

    def _compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        # any_whitespace=False: compact JSON (", " and ": "), so a model cannot pad forever.
        if kind == "json":
            schema = _exact_string_patterns(json.loads(spec))
            return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec))
            return self.compiler.compile_grammar(f"root ::= {alternatives}")
        if kind == "grammar":
            return self.compiler.compile_grammar(spec)
        raise GrammarCompileError(kind, f"unknown constraint kind {kind!r}")

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, num_rows: int) -> Any:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: Any) -> None:
        if len(grammars) < _MIN_BATCH_FILL:
            super().fill_bitmasks(grammars, bitmask)
            return
        matchers = [g.matcher for g in grammars]  # type: ignore[attr-defined]
        self.batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
