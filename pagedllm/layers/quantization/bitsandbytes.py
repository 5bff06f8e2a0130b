"""bitsandbytes pre-quantized checkpoints (``quant_method: bitsandbytes``, transformers' format).

8-bit (``load_in_8bit``, LLM.int8()): ``weight`` int8 [out, in] and ``SCB`` [out], the row's
absmax, W = Q * SCB / 127: exactly the int8 per-channel method's Q and scale, loaded as is.

4-bit (``load_in_4bit``, NF4 or FP4): ``weight`` uint8 holds two 4-bit codes per byte (the first
value in the high nibble) of the row-major flattened matrix; each block of ``blocksize`` values
(64) has an ``absmax`` and W = code_table[code] * absmax. With double quantization the absmax
are themselves uint8 codes: absmax = nested_quant_map[code] * nested_absmax[block / nested
blocksize] + offset. The layout (shape, blocksize, quant_type, nested_* and offset) is JSON
bytes in ``weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``) beside ``weight.quant_map``,
the code table (checked against the fixed NF4 / FP4 tables below). Each layer is dequantized at
load and requantized to int8 per channel (the cost is in docs/architecture.md).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.layers.quantization.checkpoint import register
from pagedllm.layers.quantization.int8 import Int8LinearMethod, quantize_per_channel
from pagedllm.layers.quantization.prequantized import CheckpointScheme, PrequantizedConfig

# The 16 values of each 4-bit code (bitsandbytes' tables, float32 as it stores them).
NF4_TABLE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
FP4_TABLE = (
    0.0, 0.0052083334885537624, 0.6666666865348816, 1.0, 0.3333333432674408, 0.5, 0.1666666716337204, 0.25,
    -0.0, -0.0052083334885537624, -0.6666666865348816, -1.0, -0.3333333432674408, -0.5, -0.1666666716337204, -0.25,
)  # fmt: skip
CODE_TABLES = {"nf4": NF4_TABLE, "fp4": FP4_TABLE}
_STATE = "weight.quant_state.bitsandbytes__"
_WHERE = "config.json's bitsandbytes quantization_config"


class BitsAndBytesConfig(PrequantizedConfig):
    name = "bitsandbytes"


class Int8Scheme(CheckpointScheme):
    """LLM.int8() rows: Q and SCB / 127 are the per-channel method's own."""

    companions = ("SCB",)
    dropped = ("weight_format",)  # "row" (0): the only layout transformers saves

    def is_quantized(self, suffix: str, tensor: torch.Tensor) -> bool:
        return tensor.dtype == torch.int8

    def ready(self, parts: dict[str, torch.Tensor]) -> bool:
        return "weight" in parts and "SCB" in parts

    def to_int8(self, prefix: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        q, scb = parts["weight"], parts["SCB"]
        if q.dim() != 2 or scb.shape != (q.shape[0],):
            raise ValueError(
                f"{prefix}.SCB has shape {tuple(scb.shape)}; weight {tuple(q.shape)} needs ({q.shape[0]},)"
            )
        return q, scb.float() / 127


class FourBitScheme(CheckpointScheme):
    """NF4 / FP4 blocks, dequantized per layer and requantized per channel."""

    companions = (
        "weight.absmax",
        "weight.quant_map",
        "weight.nested_absmax",
        "weight.nested_quant_map",
        *(_STATE + kind for kind in CODE_TABLES),
    )

    def is_quantized(self, suffix: str, tensor: torch.Tensor) -> bool:
        return tensor.dtype == torch.uint8

    def ready(self, parts: dict[str, torch.Tensor]) -> bool:
        state = _state_name(parts)
        if state is None or not {"weight", "weight.absmax", "weight.quant_map"} <= parts.keys():
            return False
        nested = "nested_blocksize" in json.loads(bytes(parts[state].tolist()))
        return not nested or {"weight.nested_absmax", "weight.nested_quant_map"} <= parts.keys()

    def to_int8(self, prefix: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_per_channel(dequantize_4bit(prefix, parts))


def _state_name(parts: dict[str, torch.Tensor]) -> str | None:
    return next((name for name in parts if name.startswith(_STATE)), None)


def dequantize_4bit(prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """W [out, in] float32 of one NF4 / FP4 layer (see the module doc)."""
    state_name = _state_name(parts)
    assert state_name is not None, "ready() saw the quant state"
    state = json.loads(bytes(parts[state_name].tolist()))
    kind, shape, blocksize = state["quant_type"], tuple(state["shape"]), int(state["blocksize"])
    table = torch.tensor(CODE_TABLES[kind])
    if not torch.equal(parts["weight.quant_map"].float().cpu(), table):
        raise ValueError(f"{prefix}.weight.quant_map is not the standard {kind} code table")
    numel = shape[0] * shape[1]
    packed = parts["weight"].reshape(-1)
    if packed.dtype != torch.uint8 or packed.numel() != -(-numel // 2):
        raise ValueError(f"{prefix}.weight holds {packed.numel()} bytes; a {shape} 4-bit weight needs {-(-numel // 2)}")
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:numel].long()
    absmax = _absmax(prefix, parts, state, -(-numel // blocksize))
    values = table[codes]
    padded = torch.nn.functional.pad(values, (0, absmax.numel() * blocksize - numel))
    return (padded.reshape(-1, blocksize) * absmax[:, None]).reshape(-1)[:numel].reshape(shape)


def _absmax(prefix: str, parts: dict[str, torch.Tensor], state: dict[str, Any], blocks: int) -> torch.Tensor:
    absmax = parts["weight.absmax"].reshape(-1)
    if absmax.numel() != blocks:
        raise ValueError(f"{prefix}.weight.absmax has {absmax.numel()} values; the weight has {blocks} blocks")
    if "nested_blocksize" not in state:
        return absmax.float()
    nested, size = parts["weight.nested_absmax"].float().reshape(-1), int(state["nested_blocksize"])
    if nested.numel() != -(-blocks // size):
        raise ValueError(f"{prefix}.weight.nested_absmax has {nested.numel()} values; needs {-(-blocks // size)}")
    codes = parts["weight.nested_quant_map"].float()[absmax.long()]
    return codes * nested.repeat_interleave(size)[:blocks] + float(state["nested_offset"])


@register("bitsandbytes")
def parse_bitsandbytes(config: dict[str, Any]) -> QuantizationConfig:
    """``load_in_8bit`` or ``load_in_4bit`` (``bnb_4bit_quant_type`` nf4 | fp4)."""
    if config.get("load_in_8bit"):
        return BitsAndBytesConfig(Int8Scheme(), Int8LinearMethod)
    if not config.get("load_in_4bit"):
        raise ValueError(f"{_WHERE} sets neither load_in_8bit nor load_in_4bit")
    kind = config.get("bnb_4bit_quant_type", "fp4")
    if kind not in CODE_TABLES:
        raise ValueError(f"{_WHERE}: bnb_4bit_quant_type {kind!r} is not supported; supported: nf4, fp4")
    return BitsAndBytesConfig(FourBitScheme(), Int8LinearMethod)
