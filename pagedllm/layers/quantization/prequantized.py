"""Pre-quantized checkpoints on the int8 layers (``int8.py`` / ``w8a8.py`` per output channel,
``int8_groups.py`` per group of inputs).

A pre-quantized checkpoint (FP8, compressed-tensors, bitsandbytes) stores each linear weight in
its own code (fp8 blocks, int8 groups, 4-bit nibbles) with its own scales. Each format is a
:class:`CheckpointScheme` that reads one layer's tensors and hands back the form its layers take
(``convert``):
- a :class:`ScaledInt8` (int8 with one float32 scale per output row, for the per-channel int8 and
  W8A8 ops; weight-only int8 stands in for W8A8 on CUDA): exactly when the checkpoint already is
  int8 per channel (compressed-tensors W8A8/W8A16 channel-wise, bitsandbytes 8-bit), otherwise
  by dequantizing that one layer to float32 and quantizing it per channel again
  (``quantize_per_channel``: an error of at most half a step of the row's max / 127 per weight);
- a :class:`GroupedInt8` (int8 with a scale, and a zero point, per row and group of inputs, for
  the group-wise op): compressed-tensors' other weight-only int8 schemes exactly, FP8 requantized
  into groups of 32 (``requantized_groups``), held by :class:`PrequantizedGroupedMethod`;
- bitsandbytes' 4-bit codes (``bitsandbytes.CodedInt4``, on the int4 table op).

:func:`convert_checkpoint` does that on the checkpoint's tensor stream, one layer at a time, so
no float32 copy of the model ever exists: the layers' parameters are integers from the start
(:class:`PrequantizedInt8Method`, :class:`PrequantizedGroupedMethod`) and each converted weight
travels as an int8 tensor carrying its scales. A linear layer the checkpoint left in float (its
ignore list) is quantized on arrival in the layer's form, as ``--quantization int8`` would. The LM
head stays float32 (:class:`DequantizingHeadMethod` widens it, should a checkpoint have quantized it).

``--quantization int8`` / ``w8a8`` / ``int4`` on a float checkpoint take the same road
(:class:`QuantizeOnLoad`): each linear whose kernel takes its shape gets quantized parameters
from construction (the method's ``on_load_method``: int8 here, packed int4 in ``int4.py``), and
each float tensor is quantized as it streams in (a row's scale, or a row's group's, is its own, so
quantizing a fused layer's shards one by one gives the same codes and scales as the whole weight),
so loading peaks at about the quantized model plus one float tensor instead of the float32 model.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from pagedllm.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizesOnLoad,
    WeightLoader,
    add_group_buffers,
    set_weight_attrs,
)
from pagedllm.layers.quantization.int8 import Int8Layer, Int8LinearMethod, PerChannelInt8Method, quantize_per_channel
from pagedllm.layers.quantization.int8_groups import GroupedInt8Method, can_store, dequantize_groups, quantize_groups
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagedllm.layers.sharding import ShardId

logger = logging.getLogger(__name__)

Weights = Iterator[tuple[str, torch.Tensor]]


class ScaledInt8(torch.Tensor):
    """Q [out, in] int8 with ``row_scale`` [out] float32 (W ~ Q * row_scale[:, None]): one
    converted checkpoint weight on its way to a :class:`PrequantizedInt8Method`'s loader."""

    row_scale: torch.Tensor


def scaled_int8(q: torch.Tensor, scale: torch.Tensor) -> ScaledInt8:
    if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
        raise AssertionError(f"a converted weight is int8 [out, in] with [out] scales, got {q.dtype} {tuple(q.shape)}")
    out = q.as_subclass(ScaledInt8)
    out.row_scale = scale.float().contiguous()
    return out


def split_scaled(loaded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q int8, scale [out]) of a checkpoint weight: a converted one as is, a float one (a layer
    the checkpoint left unquantized) quantized per channel now."""
    if isinstance(loaded, ScaledInt8):
        return loaded.as_subclass(torch.Tensor), loaded.row_scale
    if not loaded.is_floating_point():
        raise ValueError(f"a {loaded.dtype} weight came without the scales that dequantize it")
    return quantize_per_channel(loaded)


def dequantize_scaled(loaded: torch.Tensor) -> torch.Tensor:
    """A float weight for a float parameter: a :class:`ScaledInt8` or :class:`GroupedInt8`
    widened, anything else as is."""
    if isinstance(loaded, ScaledInt8):
        return loaded.as_subclass(torch.Tensor).float() * loaded.row_scale[:, None]
    if isinstance(loaded, GroupedInt8):
        return dequantize_groups(loaded.as_subclass(torch.Tensor), loaded.group_scale, loaded.group_zero)
    return loaded


# The groups a float format (FP8) is requantized into: Q8_0's 32 inputs, a scale each.
FLOAT_GROUP = 32


def requantized_groups(prefix: str, w: torch.Tensor, group: int) -> torch.Tensor:
    """A float layer's weight W [out, in] requantized into int8 groups of ``group`` inputs
    (``quantize_groups``), or per channel (:class:`ScaledInt8`) when ``group`` does not divide its
    inputs; ``prefix`` names the layer."""
    if w.dim() != 2:
        raise ValueError(f"{prefix}.weight is {tuple(w.shape)}; a linear weight is 2-D")
    if w.shape[1] % group:
        return scaled_int8(*quantize_per_channel(w))
    return grouped_int8(*quantize_groups(w, group))


class GroupedInt8(torch.Tensor):
    """Q [out, in] int8 with ``group_scale`` (and ``group_zero``, or None) [out, in / G]: W = (Q -
    z) * s per run of G inputs of a row. One converted checkpoint weight (an int8 scheme's own
    codes, exactly, or a float format requantized into groups) on its way to a
    :class:`PrequantizedGroupedMethod`'s loader."""

    group_scale: torch.Tensor
    group_zero: torch.Tensor | None


def grouped_int8(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> GroupedInt8:
    if q.dtype != torch.int8 or q.dim() != 2 or scale.dim() != 2 or q.shape[1] % scale.shape[1]:
        raise AssertionError(f"a grouped weight is int8 [out, in] with [out, in / G] scales, got {q.dtype} {q.shape}")
    out = q.as_subclass(GroupedInt8)
    out.group_scale = scale.float().contiguous()
    out.group_zero = None if zero is None else zero.float().contiguous()
    return out


def expand_scale(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int], what: str) -> torch.Tensor:
    """``scale`` [ceil(out / bn), ceil(in / bk)] (one per block of ``block`` = (bn, bk)) repeated
    to ``shape`` [out, in]; channel (bn = 1, bk = in), group (bn = 1) and per-tensor scales are
    blocks too. ValueError naming ``what`` (the tensor) when its shape does not fit."""
    (n, k), (bn, bk) = shape, block
    want = (-(-n // bn), -(-k // bk))
    if scale.numel() != want[0] * want[1]:
        raise ValueError(
            f"{what} has shape {tuple(scale.shape)}; a weight of shape {(n, k)} in blocks of {block} needs {want}"
        )
    grid = scale.float().reshape(want)
    return grid.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


class CheckpointScheme(ABC):
    """How one format stores a quantized linear weight: the tensors that make up one layer
    (``<module>.<suffix>``) and the conversion to int8 per output channel."""

    weight_suffixes: tuple[str, ...] = ("weight",)  # the quantized weight's own name(s)
    companions: tuple[str, ...] = ()  # scales and metadata that belong to the weight
    dropped: tuple[str, ...] = ()  # tensors read and ignored on CPU (say why in the format)

    @abstractmethod
    def is_quantized(self, suffix: str, tensor: torch.Tensor) -> bool:
        """Whether this weight tensor is stored quantized (a float one is a layer left in float)."""

    @abstractmethod
    def ready(self, parts: dict[str, torch.Tensor]) -> bool:
        """Whether ``parts`` (suffix -> tensor) holds everything ``to_int8`` needs."""

    @abstractmethod
    def to_int8(self, prefix: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q [out, in] int8, scale [out] float32) of the layer ``prefix`` (used in errors)."""

    def convert(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The one tensor that stands for the layer in the converted stream (default: its
        :class:`ScaledInt8`; a format its own kernel runs hands its method another form)."""
        return scaled_int8(*self.to_int8(prefix, parts))

    def split(self, name: str) -> tuple[str, str] | None:
        """(module, suffix) when ``name`` is one of this scheme's tensors, else None."""
        for suffix in sorted(self.weight_suffixes + self.companions + self.dropped, key=len, reverse=True):
            if name.endswith("." + suffix):
                return name[: -len(suffix) - 1], suffix
        return None


def convert_checkpoint(weights: Weights, scheme: CheckpointScheme) -> Weights:
    """The checkpoint's stream with every quantized layer's tensors replaced by one
    ``<module>.weight`` (a :class:`ScaledInt8`, or the scheme's own form); other tensors pass through. A layer's tensors wait
    (they are small: quantized) until all have arrived, in whatever order the files hold them."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        split = scheme.split(name)
        if split is None or (split[1] in scheme.weight_suffixes and not scheme.is_quantized(split[1], tensor)):
            yield name, tensor
            continue
        prefix, suffix = split
        if suffix in scheme.dropped:
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = tensor
        if scheme.ready(parts):
            del pending[prefix]
            yield f"{prefix}.weight", scheme.convert(prefix, parts)
    if pending:
        raise ValueError(f"incomplete quantized layers in the checkpoint: {_incomplete(pending)}")


def _incomplete(pending: dict[str, dict[str, torch.Tensor]]) -> str:
    listed = [f"{prefix} (has only {', '.join(sorted(parts))})" for prefix, parts in sorted(pending.items())]
    return "; ".join(listed[:5]) + (f"; ... and {len(listed) - 5} more" if len(listed) > 5 else "")


class PrequantizedInt8Method(LinearMethodBase):
    """``weight`` [out, in] int8 and ``weight_scale`` [out] float32 filled straight from the
    converted checkpoint (each cut to this rank's shard by the layer's loader: a row's scale does
    not depend on how its inputs are split); after loading, ``target`` (int8 weight-only or
    w8a8) lays them out for its kernel and becomes the layer's method."""

    def __init__(self, target: PerChannelInt8Method) -> None:
        self.target = target
        self.params_dtype = torch.float32  # the model's, for a weight no kernel takes

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        self.params_dtype = params_dtype
        out = sum(output_sizes)
        weight = nn.Parameter(torch.empty(out, input_size, dtype=torch.int8), requires_grad=False)
        scale = torch.empty(out, dtype=torch.float32)
        scale.output_dim, scale.input_dim = 0, None  # type: ignore[attr-defined]  # loader metadata

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            q, row_scale = split_scaled(loaded)
            weight_loader(param, q, shard_id)
            weight_loader(layer.weight_scale, row_scale, shard_id)

        set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=load)
        layer.register_parameter("weight", weight)
        layer.register_buffer("weight_scale", scale, persistent=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        typed = cast(Int8Layer, layer)
        q, scale = typed.weight.data, typed.weight_scale
        target = self._runnable_target(q)
        if target is not None:
            target.store(layer, q, scale)
            target.quantized = True
            typed.quant_method = target
            return
        logger.warning(
            "%s layer of shape %s runs in %s (its kernel needs %s)",
            self.target.format_name,
            tuple(q.shape),
            self.params_dtype,
            self.target.requirements,
        )
        typed.weight = nn.Parameter((q.float() * scale[:, None]).to(self.params_dtype), requires_grad=False)
        typed.quant_method = UnquantizedLinearMethod()
        typed.quant_method.process_weights_after_loading(layer)

    def _runnable_target(self, q: torch.Tensor) -> PerChannelInt8Method | None:
        """The target when its kernel takes Q, else the weight-only int8 method when that one's
        does (W8A8 on CUDA: the same Q and scales, activations left float), else None."""
        # A float32 stand-in of Q's shape (no memory): what the kernel checks read.
        stand_in = torch.empty((1, 1), device=q.device).expand(q.shape)
        return next((t for t in (self.target, Int8LinearMethod()) if t.can_take(stand_in)), None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError("a pre-quantized layer runs only after its quant_method.process_weights_after_loading")


def requantize_per_channel(layer: nn.Module, w: torch.Tensor, params_dtype: torch.dtype) -> None:
    """A layer whose own kernel cannot take it (CUDA, out_features % 16, no build): its float
    weight ``w`` quantized per output channel onto ``PrequantizedInt8Method``'s path (the int8
    kernel where it runs, else ``params_dtype`` with a warning), which becomes its method."""
    typed = cast(Int8Layer, layer)
    q, scale = quantize_per_channel(w)
    typed.weight = nn.Parameter(q, requires_grad=False)
    typed.weight_scale = scale
    method = PrequantizedInt8Method(Int8LinearMethod())
    method.params_dtype = params_dtype
    typed.quant_method = method
    method.process_weights_after_loading(layer)


class DequantizingHeadMethod(UnquantizedLinearMethod):
    """The float LM head of a pre-quantized model: a head the checkpoint quantized is widened."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            weight_loader(param, dequantize_scaled(loaded), shard_id)

        super().create_weights(layer, input_size, output_sizes, params_dtype, load)


class PrequantizedGroupedMethod(LinearMethodBase):
    """``weight`` [out, in] int8 with ``weight_scale`` (and, ``zero``, ``weight_zero``) [out, in / G]
    float32 filled from the converted checkpoint (:class:`GroupedInt8`: each run of the
    checkpoint's groups that a layer group divides takes its scale, so a tensor-parallel cut or a
    whole-row group splits exactly; a :class:`ScaledInt8` is a group of the whole row; a float
    weight, a layer the checkpoint left float, is quantized into groups of G), held after loading on
    the group-wise int8 op (``int8_groups.GroupedInt8Method``), or, where that op cannot run (CUDA,
    out_features % 16), dequantized and requantized per channel (:class:`PrequantizedInt8Method`).
    ``group``: G, or 0 for one group per row (G = the layer's inputs)."""

    def __init__(self, group: int, zero: bool) -> None:
        self.checkpoint_group, self.zero = group, zero
        self.group = group
        self.params_dtype = torch.float32

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        self.params_dtype = params_dtype
        group = self.group = math.gcd(self.checkpoint_group or input_size, input_size)
        out = sum(output_sizes)
        weight = nn.Parameter(torch.empty(out, input_size, dtype=torch.int8), requires_grad=False)
        add_group_buffers(
            layer, ("weight_scale", "weight_zero") if self.zero else ("weight_scale",), out, input_size // group
        )

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            q, scale, zero = self._groups(loaded)
            weight_loader(param, q, shard_id)
            weight_loader(layer.weight_scale, scale, shard_id)
            if self.zero:
                weight_loader(layer.weight_zero, torch.zeros_like(scale) if zero is None else zero, shard_id)

        set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=load)
        layer.register_parameter("weight", weight)

    def _groups(self, loaded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(Q, scale, zero or None) of a loaded tensor in this layer's groups of ``self.group``."""
        if isinstance(loaded, ScaledInt8):
            loaded = grouped_int8(loaded.as_subclass(torch.Tensor), loaded.row_scale[:, None])
        if isinstance(loaded, GroupedInt8):
            run = loaded.shape[1] // loaded.group_scale.shape[1]
            if run % self.group == 0:
                repeat = run // self.group
                zero = loaded.group_zero
                return (
                    loaded.as_subclass(torch.Tensor),
                    loaded.group_scale.repeat_interleave(repeat, dim=1),
                    None if zero is None else zero.repeat_interleave(repeat, dim=1),
                )
            loaded = dequantize_scaled(loaded)
        if not loaded.is_floating_point():
            raise ValueError(f"a {loaded.dtype} weight came without the scales that dequantize it")
        q, scale = quantize_groups(loaded, self.group)
        return q, scale, None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        typed = cast(Int8Layer, layer)
        q, scale = typed.weight.data, typed.weight_scale
        zero = cast(torch.Tensor, layer.weight_zero) if self.zero else None
        if zero is not None and not bool(zero.any()):
            zero = None  # symmetric after all
        if can_store(q):
            method = GroupedInt8Method()
            method.store(layer, q, scale, zero)
            typed.quant_method = method
            return
        # No group-wise op here: int8 per channel, as the other requantized formats.
        if self.zero:
            delattr(layer, "weight_zero")
        requantize_per_channel(layer, dequantize_groups(q, scale, zero), self.params_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError("a pre-quantized layer runs only after its quant_method.process_weights_after_loading")


class PrequantizedConfig(QuantizationConfig):
    """A pre-quantized checkpoint: its ``scheme`` converts the tensors, ``target`` runs them; with
    ``group`` (not None) the layers take the scheme's :class:`GroupedInt8` form instead, in groups of
    ``group`` inputs (0: a row's), ``zero``: with zero points (``PrequantizedGroupedMethod``)."""

    def __init__(
        self, scheme: CheckpointScheme, target: type[PerChannelInt8Method], group: int | None = None, zero: bool = False
    ) -> None:
        self.scheme, self.target, self.group, self.zero = scheme, target, group, zero

    def get_linear_method(self) -> LinearMethodBase:
        if self.group is not None:
            return PrequantizedGroupedMethod(self.group, self.zero)
        return PrequantizedInt8Method(self.target())

    def get_lm_head_method(self) -> LinearMethodBase:
        return DequantizingHeadMethod()

    def convert_checkpoint(self, weights: Weights) -> Weights:
        return convert_checkpoint(weights, self.scheme)


class QuantizeOnLoadMethod(LinearMethodBase):
    """A float checkpoint's linear for ``target`` (int8, w8a8, int4): the target's
    ``on_load_method`` (quantized parameters filled as the float tensors stream in) when its kernel
    takes the layer's shape; otherwise the target as it is (loads float, keeps it float with its
    warning)."""

    def __init__(self, target: QuantizesOnLoad) -> None:
        self.target = target
        self.inner: LinearMethodBase = target

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        # A stand-in of the weight's shape, dtype and device (no memory) for the kernel check.
        shape = (sum(output_sizes), input_size)
        if self.target.can_take(torch.empty((1, 1), dtype=params_dtype).expand(shape)):
            target = self.target
            # int8 / w8a8 fill the same parameters a pre-quantized checkpoint does (this module's)
            self.inner = (
                PrequantizedInt8Method(target) if isinstance(target, PerChannelInt8Method) else target.on_load_method()
            )
        self.inner.create_weights(layer, input_size, output_sizes, params_dtype, weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.apply(layer, x, bias)


class QuantizeOnLoad(QuantizationConfig):
    """``base`` (``int8`` / ``w8a8`` / ``int4``) for a model whose float weights come from a checkpoint."""

    def __init__(self, base: QuantizationConfig, target: type[QuantizesOnLoad]) -> None:
        self.base, self.target = base, target
        self.name = base.name  # type: ignore[misc]  # the format is still the base's

    def get_linear_method(self) -> LinearMethodBase:
        return QuantizeOnLoadMethod(self.target())

    def get_lm_head_method(self) -> LinearMethodBase:
        return self.base.get_lm_head_method()


def for_checkpoint(config: QuantizationConfig) -> QuantizationConfig:
    """The format to build a model with when its weights come from a checkpoint: one whose
    ``quantize_on_load`` names a method quantizes each float tensor as it streams in
    (:class:`QuantizeOnLoad`); any other as it is."""
    target = config.quantize_on_load
    return config if target is None else QuantizeOnLoad(config, target)
