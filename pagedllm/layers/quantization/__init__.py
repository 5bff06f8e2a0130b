"""Weight formats by name, and the one a model is being built with.

``QUANTIZATION_CONFIGS`` maps a ``--quantization`` name to its :class:`QuantizationConfig`, and
``checkpoint.CHECKPOINT_FORMATS`` a quantized checkpoint's ``quant_method`` (also a
``--quantization`` name) to a builder from its ``quantization_config``; together their names
equal the torch-free list the engine config validates against (a test checks). The model
loader builds a model inside :func:`building_with`; each linear layer and LM head asks
:func:`current_quant_config` at construction for its method, so model files never see the format.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# The pre-quantized checkpoint formats register themselves on import.
from pagedllm.layers.quantization import bitsandbytes, compressed_tensors, fp8  # noqa: F401
from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig
from pagedllm.layers.quantization.checkpoint import CHECKPOINT_FORMATS, checkpoint_quant_config
from pagedllm.layers.quantization.gguf import GGUFConfig
from pagedllm.layers.quantization.int4 import Int4Config
from pagedllm.layers.quantization.int8 import Int8Config
from pagedllm.layers.quantization.unquantized import UnquantizedConfig, UnquantizedLinearMethod
from pagedllm.layers.quantization.w4a8 import W4A8Config
from pagedllm.layers.quantization.w8a8 import W8A8Config

QUANTIZATION_CONFIGS: dict[str, type[QuantizationConfig]] = {
    "int8": Int8Config,
    "w8a8": W8A8Config,
    "int4": Int4Config,
    "w4a8": W4A8Config,
    "gguf": GGUFConfig,
}
QUANTIZATION_METHODS = (*QUANTIZATION_CONFIGS, *CHECKPOINT_FORMATS)

_UNQUANTIZED = UnquantizedConfig()
_current: QuantizationConfig = _UNQUANTIZED


def get_quantization_config(
    name: str | None, checkpoint_config: dict[str, Any] | None = None, model_extra: dict[str, Any] | None = None
) -> QuantizationConfig:
    """The config for ``name`` (None: unquantized); a checkpoint format (awq, gptq) is built from
    the checkpoint's ``quantization_config`` dict, the others from the model's ``extra`` facts
    (``QuantizationConfig.for_model``). ValueError for an unknown name."""
    if name is None:
        return _UNQUANTIZED
    if name in CHECKPOINT_FORMATS:
        return checkpoint_quant_config(name, checkpoint_config)
    if name not in QUANTIZATION_CONFIGS:
        raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATION_METHODS)}; got {name!r}")
    return QUANTIZATION_CONFIGS[name].for_model(model_extra or {})


def current_quant_config() -> QuantizationConfig:
    """The format of the model being built (unquantized outside :func:`building_with`)."""
    return _current


@contextmanager
def building_with(config: QuantizationConfig) -> Iterator[QuantizationConfig]:
    """Layers constructed inside take their methods from ``config``."""
    global _current
    previous, _current = _current, config
    try:
        yield config
    finally:
        _current = previous


__all__ = [
    "CHECKPOINT_FORMATS",
    "QUANTIZATION_CONFIGS",
    "QUANTIZATION_METHODS",
    "LinearMethodBase",
    "QuantizationConfig",
    "UnquantizedLinearMethod",
    "building_with",
    "current_quant_config",
    "get_quantization_config",
]
