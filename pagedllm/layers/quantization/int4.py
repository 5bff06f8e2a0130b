"""Group-wise int4 weight-only linears for CPU decode (``--quantization int4``), and the layout
the AWQ and GPTQ checkpoints (``awq.py``, ``gptq.py``) are repacked into.

Batch-1 decode streams every weight once per step; int4 halves int8's bytes (an eighth of
float32). One weight is W[n, k] = (q[n, k] - z[n, g]) * s[n, g]: q in 0..15, g = k // G, one
scale and one (integral) zero point per output row and group of G inputs along K (128 by default),
held in float16 when every value of the layer is exactly one (``pack_group_params``), else float32.
Activations stay float32; the kernel (``csrc/cpu_gemm_grouped.cpp``) widens the nibbles in registers.

A float weight is quantized group-wise (``quantize_groupwise``: min/max of each group, zero
included in the range so that 0 is exact and a constant group needs no special case). From a
checkpoint that happens as each tensor streams in (``Int4Config.quantize_on_load``,
:class:`Int4OnLoadMethod`): the layer holds packed nibbles from construction, so no float32 copy
of the model exists; random (``dummy``) weights are quantized after filling. Checkpoint formats
hand ``finish_int4`` their integer weights, zeros and scales instead.
A layer the kernel cannot take (out_features % 16, no kernel build) keeps a float32 weight,
the dequantized one for a checkpoint, with a warning. The LM head is in int8 groups of 32 (as for
int8: ``int8_groups``).

On a CUDA device the same integer weights are held in the CUDA layout instead and run the Triton
kernel (``triton_layout.py``): any out_features, float16 / bfloat16 / float32 activations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import lru_cache, partial
from typing import Protocol, cast

import torch
from torch import nn

from pagedllm.layers.cpu_gemm_kernels import (
    PANEL,
    fits_fp16,
    fp16_scales,
    pack_group_params,
    pack_int8,
    packable,
    unpack_int8,
)
from pagedllm.layers.cpu_kernels import cpu_ops
from pagedllm.layers.quantization import triton_layout
from pagedllm.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizesOnLoad,
    WeightLoader,
    add_group_buffers,
    create_dense_weight,
    set_weight_attrs,
)
from pagedllm.layers.quantization.int8_groups import GroupedInt8HeadMethod
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagedllm.layers.sharding import ShardId

logger = logging.getLogger(__name__)

DEFAULT_GROUP_SIZE = 128
# The smallest group a float checkpoint falls back to when 128 does not divide K: below it the
# per-group scale and zero (8 bytes) cost more than the packed weights they describe.
MIN_GROUP_SIZE = 16
_QMAX = 15
# Inputs per packed block of the CPU layout (``pack_int4``): a group must hold whole blocks.
_BLOCK_STEPS = 8

LinearInt4 = Callable[..., torch.Tensor]


@lru_cache(maxsize=1)
def load_int4_gemm() -> LinearInt4 | None:
    """``packed_linear_int4(x, packed, scale, zero, bias, group_size)`` of the selected build, or
    None when the CPU kernels are disabled or the build failed."""
    ops = cpu_ops()
    return None if ops is None else ops.packed_linear_int4.default


@lru_cache(maxsize=1)
def load_int4_table_gemm() -> LinearInt4 | None:
    """``packed_linear_int4_table(x, packed, scale, table, bias, group_size)`` (codes looked up in a
    16-value table, W = table[q] * s: bitsandbytes NF4 / FP4, GGUF IQ4) of the selected build, or
    None when the CPU kernels are disabled or the build failed."""
    ops = cpu_ops()
    return None if ops is None else ops.packed_linear_int4_table.default


@lru_cache(maxsize=1)
def load_w4a8_gemm() -> LinearInt4 | None:
    """``packed_linear_w4a8(x, packed, scale, zero, bias, group_size)`` (the same weights, int8
    activations: ``w4a8.py``) of the selected build, or None when the kernels are disabled or failed."""
    ops = cpu_ops()
    return None if ops is None else ops.packed_linear_w4a8.default


def choose_group_size(in_features: int, preferred: int = DEFAULT_GROUP_SIZE) -> int:
    """The largest power of two <= ``preferred`` dividing ``in_features`` (at least 16)."""
    group = preferred
    while group >= MIN_GROUP_SIZE:
        if in_features % group == 0:
            return group
        group //= 2
    raise ValueError(
        f"int4 needs in_features divisible by a group size of {MIN_GROUP_SIZE} to {preferred} (a power of two); "
        f"a layer has in_features={in_features}. Use --quantization int8 for this model"
    )


def quantize_groupwise(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] float -> (q [N, K] uint8 in 0..15, scale [N, K / G], zero [N, K / G]) float32 with
    W ~ (q - zero) * scale per group; each weight's error is at most scale / 2. The scales are
    rounded up to float16 values (``fp16_scales``: the kernel then reads them in half the bytes)."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group, group)
    lo = groups.amin(dim=2).clamp(max=0.0)
    hi = groups.amax(dim=2).clamp(min=0.0)
    scale = fp16_scales(torch.where(hi > lo, (hi - lo) / _QMAX, torch.ones_like(hi)), up=True)
    zero = torch.round(-lo / scale).clamp_(0, _QMAX)
    q = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp_(0, _QMAX)
    return q.reshape(n, k).to(torch.uint8), scale.contiguous(), zero.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(q - zero) * scale as float32 [N, K] (the kernels' weights, the tests' reference)."""
    group = q.shape[1] // scale.shape[1]
    return (q.float() - zero.repeat_interleave(group, dim=1)) * scale.repeat_interleave(group, dim=1)


def dequantize_table(q: torch.Tensor, scale: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table[q] * scale as float32 [N, K] (a code-table layer's weights)."""
    group = q.shape[1] // scale.shape[1]
    return table.to(q.device).float()[q.long()] * scale.float().repeat_interleave(group, dim=1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] (0..15, K % 8 == 0) -> the kernel's [N / 16, K, 8] uint8: per output, blocks of 8
    inputs as one little-endian 32-bit word (input 8 b + i in bits 4i..4i+3), the words [N, K / 8]
    then laid out as ``pack_int8`` lays out bytes (groups of 64 outputs interleaved block by block)."""
    n, k = q.shape
    if k % _BLOCK_STEPS:
        raise ValueError(f"int4 packing needs in_features % {_BLOCK_STEPS} == 0, got {k}")
    nibbles = q.to(torch.int32).reshape(n, k // 8, 8) << (4 * torch.arange(8, dtype=torch.int32))
    words = nibbles.sum(dim=2, dtype=torch.int32)  # the 8 nibbles never overlap: the sum is their OR
    return pack_int8(words).view(torch.uint8).reshape(n // PANEL, k, 8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4`` (a new [N, K] uint8 tensor)."""
    panels, k, _ = packed.shape
    words = unpack_int8(packed.reshape(-1).view(torch.int32).reshape(panels, k // 8, PANEL))
    nibbles = (words[..., None] >> (4 * torch.arange(8, dtype=torch.int32))) & 15
    return nibbles.reshape(panels * PANEL, k).to(torch.uint8)


def pack_pairs(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] (0..15, K even) -> [N, K / 2] uint8, inputs 2 i and 2 i + 1 in byte i's low and
    high nibble: the loading layout, which the layers' loaders cut like a dense weight."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_pairs`` (a new [N, K] uint8 tensor)."""
    return torch.stack([pairs & 15, pairs >> 4], dim=2).reshape(pairs.shape[0], -1)


class _Int4Layer(Protocol):
    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero: torch.Tensor | None
    weight_perm: torch.Tensor | None
    weight_table: torch.Tensor  # codes looked up in a table (finish_int4_table) only
    quant_method: LinearMethodBase


def _not_loaded_yet(*args: object) -> torch.Tensor:
    raise RuntimeError("an int4 layer runs only after its quant_method.process_weights_after_loading")


class Int4KernelMethod(LinearMethodBase):
    """What int4, AWQ and GPTQ share: the packed int4 weights and the kernel call. ``perm`` (GPTQ's
    act-order) reorders the inputs so that each group's are contiguous: x[..., perm] is used."""

    format_name = "int4"
    # Whether the CPU op quantizes the activations to int8 (``w4a8.py``) instead of keeping them float.
    int8_activations = False

    def __init__(self) -> None:
        self.group_size = 0
        self._kernel: LinearInt4 = _not_loaded_yet
        # The CPU layer's weight_zero holds offsets b (W = q * s + b) instead of zero points.
        self.zero_offset = False
        # The codes index the layer's weight_table (finish_int4_table): W = table[q] * s, no zero.
        self.code_table = False

    def finish_int4(
        self,
        layer: nn.Module,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        perm: torch.Tensor | None,
        dtype: torch.dtype = torch.float32,
        offset: torch.Tensor | None = None,
    ) -> None:
        """Store q [N, K], scale and zero [N, K / G] (inputs in ``perm`` order) in the layout of
        their device's kernel, or the dequantized weight in ``dtype`` (the model's; float32 on
        CPU) where no kernel takes them. ``offset``: the same weights' exact offsets b with
        W = q * s + b where the source has them (GGUF Q4_1's m): the CPU layer holds those instead
        of the zero points when they, not the zero points, are float16 values (half the bytes)."""
        self.group_size = q.shape[1] // scale.shape[1]
        if triton_layout.triton_device(q.device):
            self._store(layer, triton_layout.pack_int4(q), *triton_layout.int4_group_params(scale, zero), perm)
            self._kernel = triton_layout.int4_gemm()
            return
        kernel = self.cpu_kernel() if q.device.type == "cpu" else None
        if q.shape[0] % PANEL or self.group_size % _BLOCK_STEPS or kernel is None:
            self._fall_back(layer, dequantize(q, scale, zero).to(dtype), perm)
            return
        if offset is not None and not fits_fp16(scale, zero) and fits_fp16(scale, offset):
            zero, self.zero_offset = offset, True  # the offsets, not the zero points, fit float16
        self._store(layer, pack_int4(q), *pack_group_params(scale, zero), perm)
        self._kernel = partial(kernel, offset=True) if self.zero_offset else kernel

    def finish_int4_table(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, table: torch.Tensor) -> bool:
        """Store codes q [N, K] (0..15) of a 16-value ``table`` with scales [N, K / G], W =
        table[q] * s, for the CPU table op; False (nothing stored) where it cannot run them (not
        CPU, no kernel build, out_features % 16, G not a multiple of 8): the caller decides the
        fallback (``dequantize_table``)."""
        self.group_size = q.shape[1] // scale.shape[1]
        kernel = load_int4_table_gemm() if q.device.type == "cpu" else None
        if kernel is None or q.shape[0] % PANEL or self.group_size % _BLOCK_STEPS:
            return False
        packed_scale, _ = pack_group_params(scale)
        self._store(layer, pack_int4(q), packed_scale, None, None)
        layer.register_buffer("weight_table", table.float().contiguous(), persistent=False)
        self._kernel, self.code_table = kernel, True
        return True

    def cpu_kernel(self) -> LinearInt4 | None:
        """The CPU op that runs the packed int4 weights (None: not built)."""
        return load_w4a8_gemm() if self.int8_activations else load_int4_gemm()

    def _store(
        self,
        layer: nn.Module,
        weight: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        perm: torch.Tensor | None,
    ) -> None:
        cast(_Int4Layer, layer).weight = nn.Parameter(weight, requires_grad=False)
        layer.register_buffer("weight_scale", scale, persistent=False)
        layer.register_buffer("weight_zero", zero, persistent=False)
        layer.register_buffer("weight_perm", perm, persistent=False)

    def _fall_back(self, layer: nn.Module, w: torch.Tensor, perm: torch.Tensor | None) -> None:
        """Keep the dequantized weight ``w`` (inputs in ``perm`` order) as a float layer."""
        if perm is not None:
            w = torch.empty_like(w).index_copy_(1, perm, w)  # back to the checkpoint's input order
        logger.warning(
            "%s kernel not used for a weight of shape %s (needs the CPU kernels, out_features %% 16 == 0 and groups "
            "of a multiple of 8 inputs, "
            "or CUDA with triton); it runs as %s",
            self.format_name,
            tuple(w.shape),
            w.dtype,
        )
        typed = cast(_Int4Layer, layer)
        typed.weight = nn.Parameter(w, requires_grad=False)
        typed.quant_method = UnquantizedLinearMethod()
        typed.quant_method.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        typed = cast(_Int4Layer, layer)
        if typed.weight_perm is not None:
            x = x.index_select(-1, typed.weight_perm)
        second = typed.weight_table if self.code_table else typed.weight_zero
        return self._kernel(x, typed.weight, typed.weight_scale, second, bias, self.group_size)


class Int4LinearMethod(Int4KernelMethod, QuantizesOnLoad):
    """Loads the float checkpoint weight, then quantizes it group-wise (``quantize_groupwise``);
    from a checkpoint :class:`Int4OnLoadMethod` quantizes each tensor as it arrives instead."""

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        super().__init__()
        self.preferred_group = group_size
        self.quantized = False

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        self.group_size = choose_group_size(input_size, self.preferred_group)  # a clear error before loading
        create_dense_weight(layer, input_size, output_sizes, params_dtype, weight_loader)
        layer.register_buffer("weight_perm", None, persistent=False)

    def can_take(self, w: torch.Tensor) -> bool:
        return packable(w) and self.cpu_kernel() is not None

    def on_load_method(self) -> LinearMethodBase:
        return Int4OnLoadMethod(self)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.quantized:
            return
        w = cast(_Int4Layer, layer).weight.data
        if not (triton_layout.triton_device(w.device) or (w.device.type == "cpu" and w.dtype == torch.float32)):
            raise ValueError(
                f"int4 quantizes float32 CPU weights or CUDA weights (with triton), got {w.dtype} on {w.device.type}"
            )
        self.finish_int4(layer, *quantize_groupwise(w, self.group_size), None, w.dtype)
        self.quantized = True


class Int4OnLoadMethod(LinearMethodBase):
    """``target``'s layer while a float checkpoint streams in: ``weight`` [out, in / 2] uint8
    (``pack_pairs``) with ``weight_scale`` / ``weight_zero`` [out, in / G] float32, each float
    tensor (or fused shard) quantized on arrival and cut to this rank's part by the layer's loader
    (the group size is the shard's, so groups never straddle a tensor-parallel cut and the codes
    equal quantizing the shard after loading). After loading, ``target`` repacks them for its kernel."""

    def __init__(self, target: Int4LinearMethod) -> None:
        self.target = target

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        group = self.target.group_size = choose_group_size(input_size, self.target.preferred_group)
        out = sum(output_sizes)
        weight = nn.Parameter(torch.empty(out, input_size // 2, dtype=torch.uint8), requires_grad=False)
        add_group_buffers(layer, ("weight_scale", "weight_zero"), out, input_size // group)

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            q, scale, zero = quantize_groupwise(loaded, group)
            weight_loader(param, pack_pairs(q), shard_id)
            weight_loader(layer.weight_scale, scale, shard_id)
            weight_loader(layer.weight_zero, zero, shard_id)

        set_weight_attrs(weight, output_dim=0, input_dim=1, packed_dim=1, pack_factor=2, weight_loader=load)
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        typed = cast(_Int4Layer, layer)
        q, scale, zero = unpack_pairs(typed.weight.data), typed.weight_scale, cast(torch.Tensor, typed.weight_zero)
        self.target.finish_int4(layer, q, scale, zero, None)
        self.target.quantized = True
        typed.quant_method = self.target

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError("an int4 layer runs only after its quant_method.process_weights_after_loading")


class Int4Config(QuantizationConfig):
    """Group-wise int4 for the transformer's linears (a float checkpoint); the LM head in int8 groups
    of 32 (``int8_groups``)."""

    name = "int4"
    quantize_on_load = Int4LinearMethod

    def get_linear_method(self) -> LinearMethodBase:
        return Int4LinearMethod()

    def get_lm_head_method(self) -> LinearMethodBase:
        return GroupedInt8HeadMethod()
