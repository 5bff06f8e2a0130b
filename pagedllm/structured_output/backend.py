"""The grammar-engine interface (torch-free): compile a constraint once, match it per request.

A backend is built for one tokenizer and one vocabulary size (the model's, which may exceed the
tokenizer's). ``compile`` turns a constraint into an immutable compiled grammar that many
requests share; ``new_grammar`` makes the per-request matcher that advances with every accepted
token and writes the allowed-token bitmask of its next position.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any

# What each constraint kind is called in messages.
KIND_LABELS = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
_NATIVE_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")  # "[12:52:58] /project/cpp/x.cc:94: "


class GrammarCompileError(ValueError):
    """The constraint is invalid (a bad schema, regex or grammar); the message says where."""

    def __init__(self, kind: str, detail: str) -> None:
        self.kind = kind
        self.detail = detail
        super().__init__(f"invalid {KIND_LABELS.get(kind, kind)}: {detail}")


def clean_native_error(exc: BaseException) -> str:
    """A native library's error text without its timestamp/source-file prefix."""
    text = str(exc).strip()
    text = _NATIVE_PREFIX.sub("", text)
    text = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)
    return text.splitlines()[0] if text else type(exc).__name__


class StructuredOutputGrammar(ABC):
    """One request's matcher: its position in the grammar."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (bit set = allowed)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar reached its end state (its end token was accepted)."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer; makes matchers and bitmasks."""

    vocab_size: int

    @abstractmethod
    def compile(self, kind: str, spec: str) -> Any:
        """Compile ``spec`` (a key from ``StructuredOutputsParams.key()``); GrammarCompileError if invalid."""

    @abstractmethod
    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher at the start of ``compiled``."""

    @abstractmethod
    def allocate_bitmask(self, num_rows: int) -> Any:
        """An int32 ``[num_rows, ceil(vocab_size / 32)]`` bitmask buffer."""

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: Any) -> None:
        """Row i of ``bitmask`` for ``grammars[i]``; backends may batch this."""
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, row)
