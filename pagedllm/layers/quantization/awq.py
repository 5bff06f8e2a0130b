"""AWQ checkpoints (``quantization_config.quant_method: awq``, GEMM layout) on the int4 kernel.

AWQ stores per linear, K inputs, N outputs, groups of G inputs:
  qweight int32 [K, N / 8]: eight 4-bit weights per word along N, nibble i holding column
      ``AWQ_ORDER[i]`` of its eight (columns 0..7 holding 0..7 pack to 0x75316420);
  qzeros  int32 [K / G, N / 8]: the zero points, packed the same way;
  scales  fp16  [K / G, N].
W[n, k] = (q - z) * s, the int4 method's formula, so loading is a repack (``finish_int4``), one
layer at a time, with no float copy of the model. Fused layers (qkv, gate_up) load the
projections' packed tensors through the shard loaders, whose ``pack_factor`` cuts columns / 8.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from torch import nn

from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig, WeightLoader, set_weight_attrs
from pagedllm.layers.quantization.int4 import Int4KernelMethod
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod

PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def add_packed_param(
    layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, loader: WeightLoader, **attrs: Any
) -> None:
    """A checkpoint tensor the loaders fill (``output_dim`` / ``input_dim`` / ``packed_dim`` in attrs)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, weight_loader=loader, **attrs)
    layer.register_parameter(name, param)


def unpack_columns(words: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C] packed along columns -> uint8 [R, 8 C], nibble i of a word being column order[i]."""
    nibbles = (words.to(torch.int32)[..., None] >> _SHIFTS.to(words.device)) & 15  # [R, C, 8], by nibble
    by_column = nibbles[..., [order.index(c) for c in range(PACK)]]
    return by_column.reshape(words.shape[0], -1).to(torch.uint8)


def check_int4(method: str, bits: Any, group_size: Any) -> None:
    """ValueError for what the int4 kernel cannot run (``bits`` other than 4, a bad group size)."""
    if bits != 4:
        raise ValueError(
            f"{method} checkpoints with bits={bits!r} are not supported; pagedllm runs 4-bit {method} "
            "(use a 4-bit checkpoint, or the float model with --quantization int8)"
        )
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"{method} group_size must be a positive integer (or -1: one group), got {group_size!r}")


def layer_group_size(method: str, group_size: int, input_size: int) -> int:
    """The group size for a layer of ``input_size`` inputs (-1: all of them), checked to divide it."""
    group = input_size if group_size == -1 else group_size
    if input_size % group or input_size % PACK:
        raise ValueError(
            f"{method} group_size {group} does not divide a layer's in_features {input_size} (or it is not a "
            f"multiple of {PACK}); the quantization_config does not fit this model"
        )
    return group


def group_dim(group_size: int, dim: int) -> int | None:
    """The input dim of a per-group tensor (scales, zeros): ``dim``, or None with one group per
    row (-1), whose single column every tensor-parallel shard of the row shares whole."""
    return None if group_size == -1 else dim


class _AWQLayer(Protocol):
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor


class AWQLinearMethod(Int4KernelMethod):
    format_name = "awq"

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.checkpoint_group = group_size
        self.loaded = False

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        group = layer_group_size("awq", self.checkpoint_group, input_size)
        n, groups = sum(output_sizes), input_size // group
        if any(size % PACK for size in output_sizes):
            raise ValueError(f"awq packs {PACK} outputs per int32; a layer has outputs {output_sizes}")
        packed = {"output_dim": 1, "input_dim": 0, "packed_dim": 1, "pack_factor": PACK}
        add_packed_param(layer, "qweight", (input_size, n // PACK), torch.int32, weight_loader, **packed)
        grouped = {**packed, "input_dim": group_dim(self.checkpoint_group, 0)}
        add_packed_param(layer, "qzeros", (groups, n // PACK), torch.int32, weight_loader, **grouped)
        add_packed_param(
            layer, "scales", (groups, n), params_dtype, weight_loader, output_dim=1, input_dim=grouped["input_dim"]
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.loaded:
            return
        typed = cast(_AWQLayer, layer)
        q = unpack_columns(typed.qweight.data, AWQ_ORDER).t()
        zero = unpack_columns(typed.qzeros.data, AWQ_ORDER).t().float()
        scale = typed.scales.data.float().t()
        dtype = typed.scales.dtype
        for name in ("qweight", "qzeros", "scales"):
            delattr(layer, name)
        self.finish_int4(layer, q, scale.contiguous(), zero.contiguous(), None, dtype)
        self.loaded = True


class AWQConfig(QuantizationConfig):
    """An AWQ checkpoint's linears; the LM head (float in the checkpoint) stays float."""

    name = "awq"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        check_int4("awq", config.get("bits", config.get("w_bit")), config.get("group_size", config.get("q_group_size")))
        if not config.get("zero_point", True):
            raise ValueError("awq checkpoints without zero points (zero_point: false) are not supported")
        if config.get("modules_to_not_convert"):
            raise ValueError(
                f"awq checkpoints with modules_to_not_convert ({config['modules_to_not_convert']}) are not "
                "supported: every linear layer of the transformer must be quantized"
            )
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not supported; pagedllm reads the GEMM layout")
        return cls(int(config.get("group_size", config.get("q_group_size", 128))))

    def get_linear_method(self) -> LinearMethodBase:
        return AWQLinearMethod(self.group_size)

    def get_lm_head_method(self) -> LinearMethodBase:
        return UnquantizedLinearMethod()
