"""Structured outputs (JSON schema, regex, choice, grammar): ``StructuredOutputsArgs`` ->
frozen ``StructuredOutputsConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config.choices import STRUCTURED_OUTPUTS_BACKENDS
from pagedllm.config.options import check_choice, option


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "xgrammar"
    compile_timeout_s: float = 30.0  # a constraint that takes longer to compile fails its request


@dataclass
class StructuredOutputsArgs:
    """The grammar engine that constrains outputs, and its compile deadline."""

    structured_outputs_backend: str = option(
        "xgrammar",
        "grammar engine for JSON schema / regex / choice / grammar outputs",
        choices=STRUCTURED_OUTPUTS_BACKENDS,
    )
    structured_outputs_compile_timeout: float = option(
        30.0, "a constraint that does not compile within this many seconds is rejected (400)", metavar="SECONDS"
    )

    def create_structured_outputs_config(self) -> StructuredOutputsConfig:
        check_choice("structured_outputs_backend", self.structured_outputs_backend, STRUCTURED_OUTPUTS_BACKENDS)
        timeout = self.structured_outputs_compile_timeout
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"structured_outputs_compile_timeout must be > 0 seconds, got {timeout!r}")
        return StructuredOutputsConfig(self.structured_outputs_backend, float(timeout))
