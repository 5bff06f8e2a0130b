"""Pre-quantized checkpoints by ``quantization_config.quant_method`` (config.json), as vLLM does.

Each format module registers a parser: ``quantization_config`` dict -> the
:class:`QuantizationConfig` that loads it (``@register("fp8")``). The torch-free list the engine
config validates against is ``config.choices.CHECKPOINT_QUANT_METHODS`` (a test checks they agree).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.layers.quantization.base import QuantizationConfig

CheckpointParser = Callable[[dict[str, Any]], QuantizationConfig]

CHECKPOINT_FORMATS: dict[str, CheckpointParser] = {}


def register(quant_method: str) -> Callable[[CheckpointParser], CheckpointParser]:
    """Decorator: ``parse`` loads the checkpoints whose quant_method is ``quant_method``."""

    def add(parse: CheckpointParser) -> CheckpointParser:
        CHECKPOINT_FORMATS[quant_method] = parse
        return parse

    return add


def checkpoint_quant_config(quantization_config: dict[str, Any]) -> QuantizationConfig:
    """The format of a checkpoint's ``quantization_config``; ValueError listing the supported ones."""
    method = quantization_config.get("quant_method")
    if method not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"config.json's quantization_config.quant_method {method!r} is not supported; "
            f"supported: {', '.join(CHECKPOINT_FORMATS)}"
        )
    return CHECKPOINT_FORMATS[method](quantization_config)
