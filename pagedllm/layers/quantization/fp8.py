"""FP8 checkpoints (``quant_method: fp8``, as vLLM and transformers write them), loaded on CPU.

Each quantized linear stores ``weight`` in float8 (e4m3) and either a block-wise
``weight_scale_inv`` [ceil(out / bn), ceil(in / bk)] for ``weight_block_size`` [bn, bk]
(DeepSeek-V3 style; despite its name it multiplies: W = W_fp8 * scale_inv in each block) or a
per-tensor ``weight_scale`` (the older vLLM layout, W = W_fp8 * scale). A static
``input_scale`` is read and dropped: on CPU the activations stay float32, so FP8 activation
quantization does not happen and its scale has no use.

This CPU has no FP8 GEMM, so each layer is dequantized to float32 at load and quantized again to
int8 groups of 32 inputs (``prequantized.requantized_groups``: Q8_0's rule, a scale per group);
the model then runs the group-wise int8 kernel (per output channel on CUDA). That requantization
costs accuracy against the exact FP8 weights (measured in docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.layers.quantization.checkpoint import register
from pagedllm.layers.quantization.int8 import Int8LinearMethod, quantize_per_channel
from pagedllm.layers.quantization.prequantized import (
    FLOAT_GROUP,
    CheckpointScheme,
    PrequantizedConfig,
    expand_scale,
    requantized_groups,
)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_fp8(
    prefix: str, weight: torch.Tensor, scale: torch.Tensor, scale_name: str, block: tuple[int, int] | None
):
    """W [out, in] float32 = weight * scale per block (per tensor when ``block`` is None)."""
    if weight.dtype not in FP8_DTYPES or weight.dim() != 2:
        raise ValueError(f"{prefix}.weight must be a 2-D float8 tensor, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    expanded = expand_scale(scale, weight.shape, block or (n, k), f"{prefix}.{scale_name}")
    return weight.float() * expanded


class Fp8Scheme(CheckpointScheme):
    companions = ("weight_scale_inv", "weight_scale")
    dropped = ("input_scale",)

    def __init__(self, block: tuple[int, int] | None) -> None:
        self.block = block
        self.scale_name = "weight_scale_inv" if block is not None else "weight_scale"

    def is_quantized(self, suffix: str, tensor: torch.Tensor) -> bool:
        return tensor.dtype in FP8_DTYPES

    def ready(self, parts: dict[str, torch.Tensor]) -> bool:
        return "weight" in parts and any(name in parts for name in self.companions)

    def to_int8(self, prefix: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_per_channel(self.dequantized(prefix, parts))

    def convert(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The layer requantized into int8 groups of ``FLOAT_GROUP`` inputs (``requantized_groups``)."""
        return requantized_groups(prefix, self.dequantized(prefix, parts), FLOAT_GROUP)

    def dequantized(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """W [out, in] float32: the FP8 codes times their block's (or the tensor's) scale."""
        if self.scale_name not in parts:
            other = next(name for name in self.companions if name in parts)
            raise ValueError(
                f"{prefix}.{other} found but this checkpoint's quantization_config "
                f"(weight_block_size={list(self.block) if self.block else None}) stores {self.scale_name}"
            )
        return dequantize_fp8(prefix, parts["weight"], parts[self.scale_name], self.scale_name, self.block)


class Fp8Config(PrequantizedConfig):
    """FP8 weights requantized to int8 groups of 32; the group-wise int8 kernel runs them."""

    name = "fp8"


@register("fp8")
def parse_fp8(config: dict[str, Any]) -> QuantizationConfig:
    """``weight_block_size`` [bn, bk] or none (per-tensor scales); ``activation_scheme`` dynamic
    or static (its input scales are dropped on CPU)."""
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(
            f"config.json's fp8 quantization_config.activation_scheme must be dynamic or static, got {scheme!r}"
        )
    return Fp8Config(Fp8Scheme(_block_size(config.get("weight_block_size"))), Int8LinearMethod, group=FLOAT_GROUP)


def _block_size(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise ValueError(
            f"config.json's fp8 quantization_config.weight_block_size must be two positive integers, got {value!r}"
        )
    return int(value[0]), int(value[1])
