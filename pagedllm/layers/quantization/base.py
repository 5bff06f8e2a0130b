"""The two interfaces a weight format implements (vLLM's QuantizationConfig / LinearMethodBase).

A :class:`QuantizationConfig` is chosen by name (``--quantization``) and hands every linear layer
and LM head its own :class:`LinearMethodBase` at construction. The method owns the layer's weights
from end to end: ``create_weights`` registers the parameters the checkpoint fills (each with the
layer's ``weight_loader``), ``process_weights_after_loading`` converts them once for the device
(quantize, pack, reorder), and ``apply`` runs the matching kernel. So the layer itself only knows
its shard, and a new format (AWQ, GPTQ, FP8, GGUF) is one more module in this package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

WeightLoader = Callable[..., None]


class LinearMethodBase(ABC):
    """How one layer's weights are stored and multiplied. One instance per layer: it may keep
    what it chose for that layer's weights (a layout, a kernel) so ``apply`` tests nothing."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        """Register on ``layer`` the parameters for this rank's shard: ``input_size`` inputs and
        ``output_sizes`` outputs (one entry per fused projection, their sum is the layer's width)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Convert the loaded weights for the device, once (default: keep them as they are)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] @ W^T + bias`` -> ``[..., out]`` with this method's weights."""


def create_dense_weight(
    layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype, weight_loader: WeightLoader
) -> None:
    """``layer.weight`` [sum(output_sizes), input_size] in the checkpoint layout, split along
    dim 0 by column-parallel layers and dim 1 by row-parallel ones."""
    weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
    set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=weight_loader)
    layer.register_parameter("weight", weight)


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> None:
    """Attach loading metadata (``weight_loader``, ``output_dim``, ``input_dim``) to a parameter."""
    for key, value in attrs.items():
        setattr(param, key, value)


def add_group_buffers(layer: nn.Module, names: tuple[str, ...], rows: int, groups: int) -> None:
    """Float32 [rows, groups] buffers (zeros) that the checkpoint fills through the layer's loaders
    as it would a weight's columns (``output_dim`` 0, ``input_dim`` 1): a quantized layer's
    per-group scales and zero points while it loads."""
    for name in names:
        per_group = torch.zeros(rows, groups, dtype=torch.float32)
        set_weight_attrs(per_group, output_dim=0, input_dim=1)  # type: ignore[arg-type]  # a buffer, read by the loaders
        layer.register_buffer(name, per_group, persistent=False)


class QuantizesOnLoad(LinearMethodBase):
    """A method that quantizes a float weight (int8, w8a8, int4) and can do it as a checkpoint's
    tensors stream in, so no float copy of the layer is ever allocated (``prequantized.QuantizeOnLoad``)."""

    @abstractmethod
    def can_take(self, w: torch.Tensor) -> bool:
        """Whether the format's kernel takes the float weight ``w`` [out, in] (a stand-in of its
        shape, dtype and device may come: read no values)."""

    def on_load_method(self) -> LinearMethodBase:
        """A method whose parameters hold the quantized form from construction and whose loader
        quantizes each float tensor (or fused shard) on arrival; after loading it hands the layer
        to this method (``layer.quant_method = self``) exactly as quantizing after loading would.
        (The per-channel int8 methods stream through ``prequantized.PrequantizedInt8Method``,
        which builds on them, so ``QuantizeOnLoadMethod`` picks that one for them.)"""
        raise NotImplementedError(f"{type(self).__name__} cannot quantize while loading")


class QuantizationConfig(ABC):
    """A weight format: which method each linear layer and LM head gets."""

    name: ClassVar[str]
    # The method that quantizes each float tensor of a checkpoint as it streams in
    # (``prequantized.for_checkpoint``); None: the format converts after loading, if at all.
    quantize_on_load: ClassVar[type[QuantizesOnLoad] | None] = None

    @classmethod
    def for_model(cls, model_extra: Mapping[str, Any]) -> QuantizationConfig:
        """The format for a model whose architecture config carries ``model_extra`` (facts of its
        checkpoint, e.g. a GGUF file's head type); default: the format's only form."""
        return cls()

    @abstractmethod
    def get_linear_method(self) -> LinearMethodBase:
        """A fresh method for one of the transformer's linear layers."""

    @abstractmethod
    def get_lm_head_method(self) -> LinearMethodBase:
        """A fresh method for the LM head: float for the float and pre-quantized checkpoint formats
        (as the checkpoint stores it), int8 groups of 32 for the weight-only ones that quantize on
        their own, W8A8 for w8a8."""

    def convert_checkpoint(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's (name, tensor) stream as this format's parameters take it (default: as
        stored; a pre-quantized checkpoint's format rewrites its layers one at a time)."""
        return weights
