"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, llm-compressor's output).

``config_groups`` name a weight scheme (``num_bits``, ``type`` int | float, ``strategy`` channel |
group | block | tensor, ``symmetric``, ``group_size`` / ``block_structure``) and optionally
``input_activations`` for the ``targets`` (Linear); modules in ``ignore`` (lm_head) stay float.
Each quantized linear stores ``weight`` (``weight_packed`` + ``weight_shape`` when packed) with
``weight_scale`` (W = Q * scale) and, asymmetric, ``weight_zero_point`` (W = (Q - zp) * scale).

What loads, and on which CPU method:

- ``int-quantized`` W8A8 (int8 weights, int8 dynamic per-token activations) -> w8a8; a static
  ``input_scale`` is dropped and the activations are quantized per token at run time instead.
- ``naive-quantized`` / ``pack-quantized`` W8A16 (int8 weights, float activations) -> int8.
- ``float-quantized`` FP8 (per channel, per tensor or 128x128 blocks) -> int8 groups,
  requantized as in ``fp8.py``; FP8 activation quantization does not happen on CPU.

Symmetric int8 per channel loads exactly (its Q and scales are the kernel's; W8A8's kernel
takes -128 as -127, see ``w8a8.py``). Weight-only, every other int8 scheme (groups, blocks, the
tensor's, a zero point) loads exactly too, as int8 groups (``GroupedInt8``:
``prequantized.PrequantizedGroupedMethod``), and FP8 is requantized into int8 groups of 32; W8A8's
other schemes are dequantized per layer and requantized per output channel (its op's form).
Packed asymmetric int8 stores its zero points packed too, four per int32 along the output dim. 4-bit weights with float activations (W4A16
``pack-quantized``, group or channel, symmetric or with zero points) run on the int4 kernel
instead (``compressed_int4.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.layers.quantization.checkpoint import register
from pagedllm.layers.quantization.compressed_int4 import CompressedInt4Config
from pagedllm.layers.quantization.fp8 import FP8_DTYPES
from pagedllm.layers.quantization.int8 import Int8LinearMethod, quantize_per_channel
from pagedllm.layers.quantization.prequantized import (
    FLOAT_GROUP,
    CheckpointScheme,
    PrequantizedConfig,
    expand_scale,
    grouped_int8,
    requantized_groups,
)
from pagedllm.layers.quantization.w8a8 import W8A8LinearMethod

INT_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")
FORMATS = (*INT_FORMATS, "float-quantized")
STRATEGIES = ("channel", "group", "block", "tensor")
_WHERE = "config.json's compressed-tensors quantization_config"
_HEAD_NAMES = ("lm_head", "re:.*lm_head")  # how an ignore list names the LM head


class CompressedTensorsConfig(PrequantizedConfig):
    name = "compressed-tensors"


class CompressedScheme(CheckpointScheme):
    """One weight scheme for every quantized linear of the checkpoint."""

    weight_suffixes = ("weight", "weight_packed")
    companions = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
    dropped = ("input_scale", "input_zero_point")

    def __init__(self, weights: dict[str, Any], int8_activations: bool = False) -> None:
        self.num_bits, self.is_float = int(weights["num_bits"]), weights.get("type", "int") == "float"
        self.strategy, self.symmetric = weights.get("strategy", "tensor"), bool(weights.get("symmetric", True))
        # The layers take GroupedInt8 (PrequantizedGroupedMethod) unless the scheme's form is the
        # per-channel ops' own: W8A8 (its op is per channel), or symmetric int8 per channel.
        channel_int8 = not self.is_float and self.symmetric and self.strategy == "channel"
        self.grouped = not int8_activations and not channel_int8
        # Checked by _check_weights: a positive int for "group", two ints for "block".
        self.group_size: int = weights.get("group_size") or 0
        self.block_structure: list[int] = weights.get("block_structure") or []

    def is_quantized(self, suffix: str, tensor: torch.Tensor) -> bool:
        return suffix == "weight_packed" or tensor.dtype == torch.int8 or tensor.dtype in FP8_DTYPES

    def ready(self, parts: dict[str, torch.Tensor]) -> bool:
        packed = "weight_packed" in parts and "weight_shape" in parts
        needed = "weight_scale" in parts and (self.symmetric or "weight_zero_point" in parts)
        return needed and ("weight" in parts or packed)

    def group(self) -> int:
        """The int8 groups' inputs of the grouped form: the scheme's group or block columns, 0 for
        a whole row (channel, tensor), ``FLOAT_GROUP`` for FP8."""
        if self.is_float:
            return FLOAT_GROUP
        if self.strategy == "group":
            return int(self.group_size)
        return int(self.block_structure[1]) if self.strategy == "block" else 0

    def block(self, shape: torch.Size) -> tuple[int, int]:
        """The scale's block (rows, cols) for a weight of ``shape`` under this strategy."""
        n, k = shape
        if self.strategy == "channel":
            return 1, k
        if self.strategy == "group":
            return 1, int(self.group_size)
        if self.strategy == "block":
            return int(self.block_structure[0]), int(self.block_structure[1])
        return n, k

    def to_int8(self, prefix: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.codes(prefix, parts)
        scale = parts["weight_scale"]
        if self.exact(q, scale, parts):
            return q, scale.float().reshape(-1)
        return quantize_per_channel(self.dequantized(prefix, parts, q))

    def convert(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """Weight-only schemes: int8 codes as they are, with their scales (and zero points) per row
        and group (a block's for each of its rows; a channel's or the tensor's as one group of the
        row); FP8 dequantized and requantized into int8 groups of ``FLOAT_GROUP``. Else ScaledInt8."""
        if not self.grouped:
            return super().convert(prefix, parts)
        q = self.codes(prefix, parts)
        (n, k), (bn, bk) = q.shape, self.block(q.shape)
        if self.is_float or k % bk:
            return requantized_groups(prefix, self.dequantized(prefix, parts, q), FLOAT_GROUP)
        where = f"{prefix}.weight_scale"
        scale = expand_scale(parts["weight_scale"], torch.Size((n, k // bk)), (bn, 1), where)
        zero = None
        if not self.symmetric:
            name = f"{prefix}.weight_zero_point"
            zero = expand_scale(self.zero_points(prefix, parts), torch.Size((n, k // bk)), (bn, 1), name)
        return grouped_int8(q, scale, zero)

    def dequantized(self, prefix: str, parts: dict[str, torch.Tensor], q: torch.Tensor) -> torch.Tensor:
        """W [out, in] float32 from the codes, scales and zero points."""
        w = q.float()
        if not self.symmetric:
            w -= expand_scale(
                self.zero_points(prefix, parts), q.shape, self.block(q.shape), f"{prefix}.weight_zero_point"
            )
        return w * expand_scale(parts["weight_scale"], q.shape, self.block(q.shape), f"{prefix}.weight_scale")

    def exact(self, q: torch.Tensor, scale: torch.Tensor, parts: dict[str, torch.Tensor]) -> bool:
        """Symmetric int8 per channel: Q and the scales are already the kernel's."""
        per_row = scale.numel() == q.shape[0] and self.strategy == "channel"
        return per_row and q.dtype == torch.int8 and self.symmetric

    def zero_points(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The asymmetric scheme's zero points [out, groups]: as stored, or unpacked when the
        weight is packed (``pack_to_int32`` along the output dim: [out / 4, groups] int32)."""
        zp = parts["weight_zero_point"]
        if "weight_packed" not in parts:
            return zp
        out, name = int(parts["weight_shape"][0]), f"{prefix}.weight_zero_point"
        return unpack_int32(zp.t().contiguous(), self.num_bits, (zp.shape[-1], out), name).t()

    def codes(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """Q [out, in]: int8 (unpacked when packed) or float8."""
        if "weight_g_idx" in parts:
            raise ValueError(f"{prefix}.weight_g_idx: activation-ordered groups (actorder) are not supported")
        if "weight" in parts:
            q = parts["weight"]
            want = FP8_DTYPES if self.is_float else (torch.int8,)
            if q.dtype not in want or q.dim() != 2:
                raise ValueError(f"{prefix}.weight is {q.dtype} {tuple(q.shape)}; this scheme stores 2-D {want[0]}")
            return q
        shape = parts["weight_shape"].tolist()
        return unpack_int32(
            parts["weight_packed"], self.num_bits, (int(shape[0]), int(shape[1])), f"{prefix}.weight_packed"
        )


def unpack_int32(packed: torch.Tensor, num_bits: int, shape: tuple[int, int], name: str) -> torch.Tensor:
    """compressed-tensors' ``pack_to_int32`` undone: 32 / num_bits values per int32 along the
    last dim, lowest bits first, each stored as Q + 2^(num_bits - 1); ``name``: the tensor's."""
    per_word = 32 // num_bits
    n, k = shape
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, -(-k // per_word)):
        raise ValueError(
            f"{name} is {packed.dtype} {tuple(packed.shape)}; a {shape} tensor of "
            f"{num_bits}-bit values packs into int32 {(n, -(-k // per_word))}"
        )
    shifts = torch.arange(per_word, dtype=torch.int32) * num_bits
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    return (values.reshape(n, -1)[:, :k] - (1 << (num_bits - 1))).to(torch.int8)


def _is_w4a16(weights: dict[str, Any], activations: dict[str, Any] | None, fmt: str) -> bool:
    """4-bit int weights with float activations: the int4 kernel's (``compressed_int4.py``)."""
    return int(weights.get("num_bits", 8)) == 4 and weights.get("type", "int") == "int" and activations is None


def _check_w4a16(config: dict[str, Any], fmt: str) -> None:
    """W4A16 runs packed weights on every linear of the transformer (the int4 layers)."""
    if fmt != "pack-quantized":
        raise ValueError(f"{_WHERE}: 4-bit int weights must be stored pack-quantized, got format {fmt!r}")
    ignore = config.get("ignore") or []
    targets = {str(t) for g in config.get("config_groups", {}).values() for t in g.get("targets", [])}
    if "Linear" in targets and not any(name in _HEAD_NAMES for name in ignore):
        raise ValueError(
            f"{_WHERE}: a W4A16 checkpoint whose LM head is 4-bit too (lm_head not in ignore) is not supported; "
            "quantize it with ignore=['lm_head']"
        )
    left_float = [name for name in ignore if name not in _HEAD_NAMES]
    if left_float:
        raise ValueError(
            f"{_WHERE}: a W4A16 checkpoint that leaves linears unquantized ({', '.join(map(str, left_float))}) "
            "is not supported: every linear of the transformer must be 4-bit (lm_head may stay float)"
        )


def _int4_group(weights: dict[str, Any]) -> int:
    """The group size of a W4A16 scheme the int4 kernel runs (-1: per channel); ValueError else."""
    strategy = weights.get("strategy", "tensor")
    # "weight" / "static" order only GPTQ's calibration (the groups stay consecutive, no g_idx);
    # "group" / "dynamic" (and older True) store a weight_g_idx that interleaves them.
    if weights.get("actorder") not in (None, False, "weight", "static"):
        raise ValueError(
            f"{_WHERE}: activation-ordered 4-bit groups (actorder {weights['actorder']!r}, with a g_idx) are not "
            "supported; actorder 'weight' or 'static' is"
        )
    if strategy == "channel":
        return -1
    group = weights.get("group_size")
    if strategy != "group" or not isinstance(group, int) or group <= 0:
        raise ValueError(
            f"{_WHERE}: 4-bit weights need strategy 'group' with a positive group_size, or 'channel'; "
            f"got strategy {strategy!r}, group_size {group!r}"
        )
    return group


def refuse_w4a8(num_bits: object) -> None:
    """4-bit int weights reach here only with quantized activations (W4A8), which CPU does not run."""
    if num_bits == 4:
        raise ValueError(
            f"{_WHERE}: 4-bit int weights with quantized activations (W4A8) are not supported; "
            "supported: W4A16, 8-bit int (W8A8, W8A16) and 8-bit float (FP8)"
        )


@register("compressed-tensors")
def parse_compressed_tensors(config: dict[str, Any]) -> QuantizationConfig:
    weights, activations, fmt = _single_scheme(config)
    if _is_w4a16(weights, activations, fmt):
        _check_w4a16(config, fmt)
        return CompressedInt4Config(_int4_group(weights), bool(weights.get("symmetric", True)))
    _check_weights(weights, fmt)
    if weights.get("type", "int") == "int" and activations is not None and activations.get("type", "int") == "int":
        return CompressedTensorsConfig(CompressedScheme(weights, int8_activations=True), W8A8LinearMethod)
    # Weight-only (or FP8 activations, which stay float32 on CPU): symmetric int8 per channel as it is
    # on the int8 op; every other scheme in int8 groups (its own codes exactly; FP8 requantized).
    scheme = CompressedScheme(weights)
    if not scheme.grouped:
        return CompressedTensorsConfig(scheme, Int8LinearMethod)
    return CompressedTensorsConfig(scheme, Int8LinearMethod, group=scheme.group(), zero=not scheme.symmetric)


def _single_scheme(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """(weights, input_activations, format) shared by every config group (all we load)."""
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{_WHERE} has no config_groups")
    schemes = {repr((g.get("weights"), g.get("input_activations"), g.get("format"))) for g in groups.values()}
    if len(schemes) > 1:
        raise ValueError(f"{_WHERE}: config groups with different schemes are not supported; found {len(schemes)}")
    group = next(iter(groups.values()))
    for target in group.get("targets", []):
        if target != "Linear" and not str(target).startswith("re:"):
            raise ValueError(f"{_WHERE}: target {target!r} is not supported; only Linear layers are quantized")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"{_WHERE}: config group has no weights scheme")
    return weights, group.get("input_activations"), str(group.get("format") or config.get("format"))


def _check_weights(weights: dict[str, Any], fmt: str) -> None:
    kind, bits, strategy = weights.get("type", "int"), weights.get("num_bits", 0), weights.get("strategy", "tensor")
    if fmt not in FORMATS:
        raise ValueError(f"{_WHERE}: format {fmt!r} is not supported; supported: {', '.join(FORMATS)}")
    if (kind == "float") != (fmt == "float-quantized"):
        raise ValueError(f"{_WHERE}: format {fmt!r} does not hold {kind} weights")
    if kind == "int":
        refuse_w4a8(bits)
    if bits != 8 or kind not in ("int", "float"):
        raise ValueError(f"{_WHERE}: {bits}-bit {kind} weights are not supported; supported: 8-bit int or float")
    if strategy not in STRATEGIES:
        raise ValueError(f"{_WHERE}: weight strategy {strategy!r} is not supported; supported: {', '.join(STRATEGIES)}")
    if strategy == "group" and not (isinstance(weights.get("group_size"), int) and weights["group_size"] > 0):
        raise ValueError(f"{_WHERE}: strategy 'group' needs a positive group_size, got {weights.get('group_size')!r}")
    block = weights.get("block_structure")
    if strategy == "block" and not (isinstance(block, list) and len(block) == 2):
        raise ValueError(f"{_WHERE}: strategy 'block' needs block_structure [rows, cols], got {block!r}")
    if weights.get("dynamic"):
        raise ValueError(f"{_WHERE}: dynamic weight quantization is not a stored checkpoint")
