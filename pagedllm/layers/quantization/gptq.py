"""GPTQ checkpoints (``quantization_config.quant_method: gptq``, 4-bit) on the int4 kernel.

GPTQ stores per linear, K inputs, N outputs, G groups:
  qweight int32 [K / 8, N]: eight 4-bit weights per word along K, in order (rows 0..7 holding
      0..7 pack to 0x76543210);
  qzeros  int32 [G, N / 8]: the zero points packed along N, in order;
  scales  [G, N];  g_idx int32 [K]: each input's group.
W[n, k] = (q - z) * s with the group g_idx[k]. ``checkpoint_format: gptq`` (v1, the default)
stores z - 1 (AutoGPTQ's historical offset) as GPTQModel writes it, by subtracting 0x11111111
from each whole word, so a zero point of 0 borrows from the nibble above; ``gptq_v2`` z itself; symmetric (``sym``)
checkpoints store z = 8 like any other, so the stored zeros are used either way. Without ``desc_act`` the
groups are consecutive runs of ``group_size`` inputs and g_idx is not needed. With it (act-order)
the groups interleave: the loader sorts the inputs by group (a permutation, kept to reorder the
activations at run time), so the kernel sees contiguous groups. Act-order checkpoints load at
tensor_parallel_size 1 only (a row-parallel shard's inputs would reach other ranks' groups).
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.quantization.awq import (
    PACK,
    add_packed_param,
    check_int4,
    group_dim,
    layer_group_size,
    unpack_columns,
)
from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig, WeightLoader
from pagedllm.layers.quantization.int4 import Int4KernelMethod
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagedllm.layers.sharding import ShardId

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
GPTQ_ORDER = tuple(range(PACK))


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] packed along rows, in order -> uint8 [8 R, C]."""
    return unpack_columns(words.t().contiguous(), GPTQ_ORDER).t()


def v1_zero_words_to_v2(words: torch.Tensor) -> torch.Tensor:
    """v1 qzeros words -> the zero points themselves (v2): add 0x11111111 to each whole word, the
    inverse of GPTQModel's v2-to-v1 export (and its own v1 loader). Where no zero point is 0 this is
    1 added to each nibble; where one is, it takes back the borrow that the export took from the
    nibble above, which adding 1 per nibble would miss."""
    wide = (words.to(torch.int64) + 0x11111111) & 0xFFFFFFFF
    return (wide - ((wide >> 31) << 32)).to(torch.int32)  # back into int32's range, same bits


def act_order_permutation(g_idx: torch.Tensor, group: int) -> torch.Tensor:
    """The inputs sorted by group (stable); ValueError unless each of the K / G groups has G inputs."""
    k = g_idx.numel()
    g_idx = g_idx.long()
    if g_idx.min() < 0 or g_idx.max() >= k // group or not bool((torch.bincount(g_idx) == group).all()):
        raise ValueError(f"gptq g_idx must assign exactly group_size={group} inputs to each of {k // group} groups")
    return torch.argsort(g_idx, stable=True)


class _GPTQLayer(Protocol):
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor


class GPTQLinearMethod(Int4KernelMethod):
    format_name = "gptq"

    def __init__(self, config: GPTQConfig) -> None:
        super().__init__()
        self.config = config
        self.checkpoint_group = 0
        self.loaded = False

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        group = self.checkpoint_group = layer_group_size("gptq", self.config.group_size, input_size)
        n, groups = sum(output_sizes), input_size // group
        if any(size % PACK for size in output_sizes):
            raise ValueError(f"gptq packs {PACK} outputs per int32 in qzeros; a layer has outputs {output_sizes}")
        add_packed_param(
            layer, "qweight", (input_size // PACK, n), torch.int32, weight_loader, output_dim=1, input_dim=0
        )
        zeros = {
            "output_dim": 1,
            "input_dim": group_dim(self.config.group_size, 0),
            "packed_dim": 1,
            "pack_factor": PACK,
        }
        add_packed_param(layer, "qzeros", (groups, n // PACK), torch.int32, weight_loader, **zeros)
        add_packed_param(
            layer, "scales", (groups, n), params_dtype, weight_loader, output_dim=1, input_dim=zeros["input_dim"]
        )
        add_packed_param(
            layer, "g_idx", (input_size,), torch.int32, self._g_idx_loader(weight_loader), output_dim=None, input_dim=0
        )

    def _g_idx_loader(self, weight_loader: WeightLoader) -> WeightLoader:
        """The layer's loader, refusing fused projections whose act-orders differ: the fused
        layer sorts its one input once."""
        loaded: list[torch.Tensor] = []

        def load(param: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId = None) -> None:
            if self.config.desc_act and loaded and not torch.equal(loaded[0], tensor.to(torch.int32)):
                raise ValueError("the fused projections of one input have different g_idx (act-order); unsupported")
            weight_loader(param, tensor, shard_id)
            loaded[:] = [tensor.to(torch.int32)]

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.loaded:
            return
        typed = cast(_GPTQLayer, layer)
        q = unpack_rows(typed.qweight.data).t()
        words = typed.qzeros.data
        if self.config.checkpoint_format == "gptq":
            words = v1_zero_words_to_v2(words)
        zero = unpack_columns(words, GPTQ_ORDER)
        scale, dtype = typed.scales.data.float().t().contiguous(), typed.scales.dtype
        perm = act_order_permutation(typed.g_idx.data, self.checkpoint_group) if self.config.desc_act else None
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            delattr(layer, name)
        if perm is not None:
            q = q.index_select(1, perm)
        self.finish_int4(layer, q.contiguous(), scale, zero.t().float().contiguous(), perm, dtype)
        self.loaded = True


class GPTQConfig(QuantizationConfig):
    """A 4-bit GPTQ checkpoint's linears; the LM head (float in the checkpoint) stays float."""

    name = "gptq"

    def __init__(self, group_size: int, desc_act: bool, checkpoint_format: str) -> None:
        self.group_size, self.desc_act, self.checkpoint_format = group_size, desc_act, checkpoint_format

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        check_int4("gptq", config.get("bits"), config.get("group_size", 128))
        checkpoint_format = str(config.get("checkpoint_format", "gptq"))
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"gptq checkpoint_format must be one of {', '.join(CHECKPOINT_FORMATS)}, got {checkpoint_format!r}"
            )
        if config.get("is_marlin_format"):
            raise ValueError(
                "gptq checkpoints in marlin's repacked layout (is_marlin_format: true) are not supported; "
                "use the plain gptq export of the model"
            )
        if config.get("lm_head"):
            raise ValueError(
                "gptq checkpoints with a quantized LM head (lm_head: true) are not supported; "
                "use one quantized with the LM head left in float (GPTQModel's default)"
            )
        desc_act = bool(config.get("desc_act", False))
        if desc_act and get_tp_group().size > 1:
            raise ValueError("gptq checkpoints with desc_act (act-order) load only at tensor_parallel_size 1")
        return cls(int(config.get("group_size", 128)), desc_act, checkpoint_format)

    def get_linear_method(self) -> LinearMethodBase:
        return GPTQLinearMethod(self)

    def get_lm_head_method(self) -> LinearMethodBase:
        return UnquantizedLinearMethod()
