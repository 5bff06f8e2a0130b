"""bitsandbytes pre-quantized checkpoints (``quant_method: bitsandbytes``, transformers' format).

8-bit (``load_in_8bit``, LLM.int8()): ``weight`` int8 [out, in] and ``SCB`` [out], the row's
absmax, W = Q * SCB / 127: exactly the int8 per-channel method's Q and scale, loaded as is.

4-bit (``load_in_4bit``, NF4 or FP4): ``weight`` uint8 holds two 4-bit codes per byte (the first
value in the high nibble) of the row-major flattened matrix; each block of ``blocksize`` values
(64) has an ``absmax`` and W = code_table[code] * absmax. With double quantization the absmax
are themselves uint8 codes: absmax = nested_quant_map[code] * nested_absmax[block / nested
blocksize] + offset. The layout (shape, blocksize, quant_type, nested_* and offset) is JSON
bytes in ``weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``) beside ``weight.quant_map``,
the code table (checked against the fixed NF4 / FP4 tables below). On CPU the codes stay 4-bit
and run exactly on the int4 kernel with the table (``packed_linear_int4_table``: W = table[q] *
s, :class:`CodebookInt4Method`): each run of inputs within one block and one row (their gcd) is a
group whose scale is its block's absmax. Where that kernel cannot run (CUDA, out_features % 16,
no kernel build) the layer is dequantized and requantized to int8 per channel instead.
"""

from __future__ import annotations

import json
import math
from typing import Any, Protocol, cast

import torch
from torch import nn

from pagedllm.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    WeightLoader,
    add_group_buffers,
    set_weight_attrs,
)
from pagedllm.layers.quantization.checkpoint import register
from pagedllm.layers.quantization.int4 import Int4KernelMethod, dequantize_table, pack_pairs, unpack_pairs
from pagedllm.layers.quantization.int8 import Int8LinearMethod, quantize_per_channel
from pagedllm.layers.quantization.prequantized import CheckpointScheme, PrequantizedConfig, requantize_per_channel
from pagedllm.layers.sharding import ShardId

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

    def convert(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return coded_int4(prefix, parts)


def _state_name(parts: dict[str, torch.Tensor]) -> str | None:
    return next((name for name in parts if name.startswith(_STATE)), None)


def _read_4bit(
    prefix: str, parts: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, int, str, tuple[int, int]]:
    """(codes [out * in] uint8, absmax [blocks], blocksize, kind, shape) of one NF4 / FP4 layer."""
    state_name = _state_name(parts)
    assert state_name is not None, "ready() saw the quant state"
    state = json.loads(bytes(parts[state_name].tolist()))
    kind, shape, blocksize = state["quant_type"], tuple(state["shape"]), int(state["blocksize"])
    if kind not in CODE_TABLES or len(shape) != 2:
        raise ValueError(f"{prefix}: a 4-bit {kind!r} weight of shape {shape}; supported: 2-D nf4 and fp4 weights")
    if not torch.equal(parts["weight.quant_map"].float().cpu(), torch.tensor(CODE_TABLES[kind])):
        raise ValueError(f"{prefix}.weight.quant_map is not the standard {kind} code table")
    numel = shape[0] * shape[1]
    packed = parts["weight"].reshape(-1)
    if packed.dtype != torch.uint8 or packed.numel() != -(-numel // 2):
        raise ValueError(f"{prefix}.weight holds {packed.numel()} bytes; a {shape} 4-bit weight needs {-(-numel // 2)}")
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:numel]
    absmax = _absmax(prefix, parts, state, -(-numel // blocksize))
    return codes, absmax, blocksize, kind, (int(shape[0]), int(shape[1]))


def dequantize_4bit(prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """W [out, in] float32 of one NF4 / FP4 layer (see the module doc)."""
    codes, absmax, blocksize, kind, shape = _read_4bit(prefix, parts)
    numel = codes.numel()
    values = torch.tensor(CODE_TABLES[kind])[codes.long()]
    padded = torch.nn.functional.pad(values, (0, absmax.numel() * blocksize - numel))
    return (padded.reshape(-1, blocksize) * absmax[:, None]).reshape(-1)[:numel].reshape(shape)


class CodedInt4(torch.Tensor):
    """One NF4 / FP4 layer on its way to :class:`CodebookInt4Method`'s loader: its codes [out, in / 2]
    (``pack_pairs``) with ``group_scale`` [out, in / u], the absmax of the block each run of u =
    gcd(in, blocksize) inputs of a row lies in (such a run never straddles a block or a row)."""

    group_scale: torch.Tensor
    kind: str  # nf4 | fp4


def coded_int4(prefix: str, parts: dict[str, torch.Tensor]) -> CodedInt4:
    codes, absmax, blocksize, kind, (out, inputs) = _read_4bit(prefix, parts)
    if inputs % 2:
        raise ValueError(
            f"{prefix}: a 4-bit weight of {inputs} inputs; pagedllm runs 4-bit layers of an even input size"
        )
    run = math.gcd(inputs, blocksize)
    starts = torch.arange(out)[:, None] * inputs + torch.arange(0, inputs, run)[None, :]
    coded = pack_pairs(codes.reshape(out, inputs)).as_subclass(CodedInt4)
    coded.group_scale = absmax[starts // blocksize].contiguous()
    coded.kind = kind
    return coded


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


# The group size of a 4-bit layer (inputs per scale): bitsandbytes' default block of 64 values,
# or gcd(in_features, 64) when blocks straddle rows. A checkpoint's blocks of a multiple of it
# (128, 256, ...) repeat their scales; smaller blocks are refused.
BLOCK = 64


def quantize_to_table(w: torch.Tensor, group: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] float -> (codes [out, in] uint8, scale [out, in / group]): each group's absmax
    and each weight's nearest table value, as bitsandbytes quantizes (a layer the checkpoint left
    in float that shares a fused layer with 4-bit ones)."""
    out, inputs = w.shape
    groups = w.float().reshape(out, inputs // group, group)
    scale = groups.abs().amax(dim=2).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.empty(out, inputs // group, group, dtype=torch.uint8, device=w.device)
    values = table.to(w.device)
    for start in range(0, out, 256):  # the distances to the 16 values, 256 rows at a time
        rows = slice(start, start + 256)
        codes[rows] = (groups[rows, ..., None] / scale[rows, :, None, None] - values).abs().argmin(dim=-1)
    return codes.reshape(out, inputs), scale


class _CodedLayer(Protocol):
    weight: torch.Tensor
    weight_scale: torch.Tensor
    quant_method: LinearMethodBase


class CodebookInt4Method(Int4KernelMethod):
    """An NF4 / FP4 layer: ``weight`` [out, in / 2] uint8 codes (``pack_pairs``) and ``weight_scale``
    [out, in / G] float32 filled from the converted checkpoint (:class:`CodedInt4`; cut to this
    rank's shard by the layer's loaders like a dense weight), then packed for the int4 kernel with
    the code table (``packed_linear_int4_table``); see the module doc for where it falls back."""

    format_name = "bitsandbytes 4-bit"

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.table = torch.tensor(CODE_TABLES[kind], dtype=torch.float32)
        self.params_dtype = torch.float32
        self.loaded = False

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        if input_size % 2:
            raise ValueError(f"a 4-bit layer of {input_size} inputs; pagedllm runs 4-bit layers of an even input size")
        group = self.group_size = math.gcd(input_size, BLOCK)
        self.params_dtype = params_dtype
        out = sum(output_sizes)
        weight = nn.Parameter(torch.empty(out, input_size // 2, dtype=torch.uint8), requires_grad=False)
        add_group_buffers(layer, ("weight_scale",), out, input_size // group)

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            pairs, group_scale = self._codes(loaded)
            weight_loader(param, pairs, shard_id)
            weight_loader(layer.weight_scale, group_scale, shard_id)

        set_weight_attrs(weight, output_dim=0, input_dim=1, packed_dim=1, pack_factor=2, weight_loader=load)
        layer.register_parameter("weight", weight)

    def _codes(self, loaded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [out, in / 2], scale [out, in / G]) of a loaded tensor: a converted layer's, or a
        float one (a layer the checkpoint left unquantized) quantized to the table now."""
        group = self.group_size
        if isinstance(loaded, CodedInt4):
            if loaded.kind != self.kind:
                raise ValueError(
                    f"a {loaded.kind} weight in a checkpoint whose {_WHERE} says bnb_4bit_quant_type {self.kind!r}"
                )
            scale = loaded.group_scale
            run = loaded.shape[1] * 2 // scale.shape[1]
            if run % group:
                raise ValueError(
                    f"bitsandbytes 4-bit blocks of {run} values in a layer whose groups are {group} inputs; "
                    f"pagedllm reads blocks of {BLOCK} values or a multiple of it (bitsandbytes' default is {BLOCK})"
                )
            return loaded.as_subclass(torch.Tensor), scale.repeat_interleave(run // group, dim=1)
        if not loaded.is_floating_point():
            raise ValueError(f"a {loaded.dtype} weight reached a 4-bit layer without its quantization state")
        codes, scale = quantize_to_table(loaded, group, self.table)
        return pack_pairs(codes), scale

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.loaded:
            return
        self.loaded = True
        typed = cast(_CodedLayer, layer)
        q, scale = unpack_pairs(typed.weight.data), typed.weight_scale
        if self.finish_int4_table(layer, q, scale, self.table):
            return
        # No kernel takes the codes here: int8 per channel, as the other requantized formats.
        requantize_per_channel(layer, dequantize_table(q, scale, self.table), self.params_dtype)


class BitsAndBytes4bitConfig(BitsAndBytesConfig):
    """NF4 / FP4 checkpoints: the linears on :class:`CodebookInt4Method`, the LM head float."""

    def __init__(self, kind: str) -> None:
        super().__init__(FourBitScheme(), Int8LinearMethod)
        self.kind = kind

    def get_linear_method(self) -> LinearMethodBase:
        return CodebookInt4Method(self.kind)


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
    return BitsAndBytes4bitConfig(kind)
