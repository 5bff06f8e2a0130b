"""Quantized checkpoints: ``config.json``'s ``quantization_config.quant_method`` -> the format.

As in vLLM, a checkpoint quantized by another tool says how in ``quantization_config``; each
format registers a builder that turns that dict into its :class:`QuantizationConfig` (with a
ValueError for settings it cannot run): awq and gptq run on the int4 kernel; fp8,
compressed-tensors and bitsandbytes convert onto the int8 / w8a8 layers as they load
(``prequantized.py``). The format names are also ``--quantization`` values
(``config/choices.CHECKPOINT_QUANT_METHODS``, checked by a test), and the engine config picks the
format from the checkpoint (``config/model.resolve_quantization``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.layers.quantization.awq import AWQConfig
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.layers.quantization.gptq import GPTQConfig

CheckpointConfigBuilder = Callable[[dict[str, Any]], QuantizationConfig]

CHECKPOINT_FORMATS: dict[str, CheckpointConfigBuilder] = {}


def register(quant_method: str) -> Callable[[CheckpointConfigBuilder], CheckpointConfigBuilder]:
    """Decorator: ``builder`` reads the checkpoints whose quant_method is ``quant_method``."""

    def add(builder: CheckpointConfigBuilder) -> CheckpointConfigBuilder:
        CHECKPOINT_FORMATS[quant_method] = builder
        return builder

    return add


def checkpoint_quant_config(quant_method: str, config: dict[str, Any] | None) -> QuantizationConfig:
    """The format of a checkpoint's ``quantization_config`` (``config``); ValueError when the
    format is unknown or the checkpoint has no such config."""
    if quant_method not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"quantization_config.quant_method {quant_method!r} is not supported; "
            f"supported: {', '.join(CHECKPOINT_FORMATS)}"
        )
    if not config or str(config.get("quant_method", "")).lower() != quant_method:
        raise ValueError(
            f"quantization={quant_method!r} reads a {quant_method} checkpoint, but config.json has no "
            f"quantization_config with quant_method {quant_method!r}"
        )
    return CHECKPOINT_FORMATS[quant_method](config)


register("awq")(AWQConfig.from_config)
register("gptq")(GPTQConfig.from_config)
