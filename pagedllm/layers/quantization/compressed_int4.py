"""compressed-tensors W4A16 (``pack-quantized`` int4, symmetric or not) on the int4 kernel.

Per linear of N outputs and K inputs the checkpoint stores:
  weight_packed     int32 [N, K / 8]: eight 4-bit values per word along K, lowest bits first, each
      the signed value q in -8..7 stored as q + 8;
  weight_scale      [N, K / G] (``group`` strategy; one column for ``channel``);
  weight_zero_point int32 [N / 8, K / G] (asymmetric only, ``symmetric: false``): the signed zero
      points zp in -8..7 stored as zp + 8, eight per word along the *output* dim, lowest bits first;
  weight_shape      [2] (the unpacked shape; read from the config instead, so dropped).
W = (q - zp) * s = ((q + 8) - (zp + 8)) * s: the int4 method's (u - z) * s with u and z the stored
nibbles (z = 8 when symmetric), so loading is a repack (``finish_int4``) one layer at a time.
Activation-ordered groups and quantized activations (W4A8) are refused (``compressed_tensors.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, cast

import torch
from torch import nn

from pagedllm.layers.quantization.awq import PACK, add_packed_param, group_dim, layer_group_size, unpack_columns
from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig, WeightLoader
from pagedllm.layers.quantization.int4 import Int4KernelMethod
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod

_IN_ORDER = tuple(range(PACK))  # value j of a word is input 8 w + j
_OFFSET = 8  # stored value = q + 8


class _PackedLayer(Protocol):
    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero_point: torch.Tensor


class CompressedInt4Method(Int4KernelMethod):
    format_name = "compressed-tensors"

    def __init__(self, group_size: int, symmetric: bool) -> None:
        super().__init__()
        self.checkpoint_group = group_size  # -1: one group per row (the channel strategy)
        self.symmetric = symmetric
        self.loaded = False

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        group = layer_group_size("compressed-tensors", self.checkpoint_group, input_size)
        n, packed = sum(output_sizes), {"output_dim": 0, "input_dim": 1, "packed_dim": 1, "pack_factor": PACK}
        add_packed_param(layer, "weight_packed", (n, input_size // PACK), torch.int32, weight_loader, **packed)
        scale_input = group_dim(self.checkpoint_group, 1)
        add_packed_param(
            layer,
            "weight_scale",
            (n, input_size // group),
            params_dtype,
            weight_loader,
            output_dim=0,
            input_dim=scale_input,
        )
        if not self.symmetric:
            if any(size % PACK for size in output_sizes):
                raise ValueError(
                    f"compressed-tensors packs {PACK} zero points per int32; a layer has outputs {output_sizes}"
                )
            by_rows = {"output_dim": 0, "packed_dim": 0, "pack_factor": PACK, "input_dim": scale_input}
            add_packed_param(
                layer, "weight_zero_point", (n // PACK, input_size // group), torch.int32, weight_loader, **by_rows
            )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.loaded:
            return
        typed = cast(_PackedLayer, layer)
        q = unpack_columns(typed.weight_packed.data, _IN_ORDER)
        scale, dtype = typed.weight_scale.data.float().contiguous(), typed.weight_scale.dtype
        if self.symmetric:
            zero = torch.full_like(scale, float(_OFFSET))
        else:  # [N / 8, G] packed down the rows: unpacked as the columns of its transpose
            zero = unpack_columns(typed.weight_zero_point.data.t(), _IN_ORDER).t().float().contiguous()
            delattr(layer, "weight_zero_point")
        for name in ("weight_packed", "weight_scale"):
            delattr(layer, name)
        self.finish_int4(layer, q, scale, zero, None, dtype)
        self.loaded = True


class CompressedInt4Config(QuantizationConfig):
    """A W4A16 compressed-tensors checkpoint's linears; the LM head (left float) stays float."""

    name = "compressed-tensors"

    def __init__(self, group_size: int, symmetric: bool = True) -> None:
        self.group_size, self.symmetric = group_size, symmetric

    def get_linear_method(self) -> LinearMethodBase:
        return CompressedInt4Method(self.group_size, self.symmetric)

    def get_lm_head_method(self) -> LinearMethodBase:
        return UnquantizedLinearMethod()

    def convert_checkpoint(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream without the ``weight_shape`` tensors (the config gives every shape)."""
        return ((name, t) for name, t in weights if not name.endswith(".weight_shape"))
