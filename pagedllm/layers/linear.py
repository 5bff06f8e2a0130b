"""Linear layers that own tensor parallelism (Megatron-style column / row splits).

A linear layer is a shard plus a method. The layer knows which slice of the full weight is this
rank's (from ``distributed.parallel_state``, asked once at construction) and gives every parameter
``weight_loader(param, loaded_weight, shard_id=None)``, which cuts that slice out of a full
checkpoint tensor (and, for fused layers, puts a ``q_proj`` or ``up_proj`` shard in its place), so
the model's ``load_weights`` stays a few lines. Its ``quant_method`` (``layers/quantization``),
chosen by the format the model is built with, creates the parameters, converts them after loading
and runs the GEMM. Dense weights use the checkpoint layout ``[out_features, in_features]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.quantization import QuantizationConfig, current_quant_config
from pagedllm.layers.quantization.base import set_weight_attrs
from pagedllm.layers.sharding import (
    ShardId,
    copy_checked,
    divide,
    divide_packed,
    input_dim,
    narrow_checked,
    output_dim,
    pack_factor,
)
from pagedllm.lora.context import current_lora_step


class LinearBase(nn.Module):
    """y = x W^T + b on this rank's slice; subclasses define the slice (:meth:`partition`) and
    its ``weight_loader``. ``quant_config`` defaults to the one the model is being built with.
    ``lora``: the adapters' slots (``lora.layers.LoRASlots``) when LoRA is on; their delta is
    added after the quant method's GEMM, whatever the weight format."""

    lora: Any = None

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool, quant_config: QuantizationConfig | None = None
    ) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.input_size, self.output_sizes = self.partition(input_size, output_sizes)
        self.quant_method = (quant_config or current_quant_config()).get_linear_method()
        self.quant_method.create_weights(
            self, self.input_size, self.output_sizes, torch.get_default_dtype(), self.weight_loader
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.output_sizes)), requires_grad=False)
            set_weight_attrs(self.bias, output_dim=0, input_dim=None, weight_loader=self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def partition(self, input_size: int, output_sizes: list[int]) -> tuple[int, list[int]]:
        """(this rank's input size, its output size per fused projection) for the full sizes."""
        raise NotImplementedError

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(x, self.quant_method.apply(self, x, self.bias))

    def add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus the adapters' delta of the step's adapter tokens (none: ``y`` unchanged)."""
        if self.lora is None or (step := current_lora_step()) is None:
            return y
        return self.lora.add_delta(x, y, step)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the result stays split (it feeds a row-parallel layer)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, quant_config: QuantizationConfig | None = None
    ) -> None:
        super().__init__(input_size, [output_size], bias, quant_config)

    def partition(self, input_size: int, output_sizes: list[int]) -> tuple[int, list[int]]:
        return input_size, [divide(n, self.tp.size, "output size") for n in output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        dim = output_dim(param)
        if dim is None:  # not split by outputs (GPTQ's g_idx): every rank holds it whole
            copy_checked(param, loaded_weight)
            return
        rows = param.shape[dim]
        copy_checked(param, narrow_checked(loaded_weight, dim, self.tp.rank * rows, rows))

    def load_fused_shard(self, param: nn.Parameter, loaded_weight: torch.Tensor, index: int, source: int) -> None:
        """Copy projection ``index``'s slice number ``source`` of a checkpoint tensor into its
        place in the fused parameter (the projections are concatenated along the output dim,
        ``pack_factor`` outputs per element when the parameter packs them, as AWQ's qweight)."""
        dim = output_dim(param)
        if dim is None:  # the same for every projection of one input (GPTQ's g_idx)
            copy_checked(param, loaded_weight)
            return
        factor = pack_factor(param, dim)
        size = divide_packed(self.output_sizes[index], factor)
        offset = sum(self.output_sizes[:index]) // factor
        copy_checked(param.data.narrow(dim, offset, size), narrow_checked(loaded_weight, dim, source * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate_proj + up_proj).

    Each rank's weight is the concatenation of its slice of every projection, so the output
    splits back into per-projection chunks locally. ``shard_id`` is the projection's index.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        LinearBase.__init__(self, input_size, output_sizes, bias, quant_config)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        self.load_fused_shard(param, loaded_weight, shard_id, self.tp.rank)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across ranks.

    With fewer KV heads than ranks (GQA/MQA at high TP) each KV head is replicated on
    ``tp_size // num_kv_heads`` ranks. ``num_heads`` / ``num_kv_heads`` are this rank's counts,
    which is what the attention layer must be built with.
    """

    _SHARD_IDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        self.head_dim, self.total_num_heads, self.total_num_kv_heads = head_dim, total_num_heads, total_num_kv_heads
        LinearBase.__init__(
            self,
            hidden_size,
            [total_num_heads * head_dim, total_num_kv_heads * head_dim, total_num_kv_heads * head_dim],
            bias,
            quant_config,
        )

    def partition(self, input_size: int, output_sizes: list[int]) -> tuple[int, list[int]]:
        tp_size = self.tp.size
        self.num_heads = divide(self.total_num_heads, tp_size, "num_attention_heads")
        if self.total_num_kv_heads >= tp_size:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size, "num_key_value_heads")
        elif tp_size % self.total_num_kv_heads:
            raise ValueError(
                f"the tensor-parallel size ({tp_size}) exceeds num_key_value_heads "
                f"({self.total_num_kv_heads}) but is not a multiple of it"
            )
        else:
            self.num_kv_heads = 1
        self.kv_replicas = max(1, tp_size // self.total_num_kv_heads)
        kv = self.num_kv_heads * self.head_dim
        return input_size, [self.num_heads * self.head_dim, kv, kv]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        """``shard_id``: "q"/"k"/"v" or its index 0/1/2 (the order of the packed-modules mapping)."""
        index = self._SHARD_IDS.index(shard_id) if shard_id in self._SHARD_IDS else shard_id
        if index not in (0, 1, 2):
            raise ValueError(f"shard_id must be one of q, k, v (or 0, 1, 2), got {shard_id!r}")
        # Which copy of the heads this rank holds: q heads are never replicated, k/v may be.
        source = self.tp.rank if index == 0 else self.tp.rank // self.kv_replicas
        self.load_fused_shard(param, loaded_weight, index, source)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed with an all-reduce."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, quant_config: QuantizationConfig | None = None
    ) -> None:
        super().__init__(input_size, [output_size], bias, quant_config)

    def partition(self, input_size: int, output_sizes: list[int]) -> tuple[int, list[int]]:
        return divide(input_size, self.tp.size, "input size"), output_sizes

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        dim = input_dim(param)
        if dim is None:  # the bias is not split
            copy_checked(param, loaded_weight)
            return
        cols = param.shape[dim]
        copy_checked(param, narrow_checked(loaded_weight, dim, self.tp.rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only rank 0 adds the bias so the all-reduce counts it once.
        y = self.quant_method.apply(self, x, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(self.add_lora(x, y))
