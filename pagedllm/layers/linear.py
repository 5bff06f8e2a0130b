"""Linear layers that own tensor parallelism (Megatron-style column / row splits).

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``: the layer knows
which slice of a full checkpoint tensor belongs to this rank (and, for fused layers, where a
``q_proj`` or ``up_proj`` shard goes), so the model's ``load_weights`` stays a few lines.
Weights use the checkpoint layout ``[out_features, in_features]``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.distributed.parallel_state import all_reduce, get_tp_rank, get_tp_size
from pagedllm.layers.cpu_gemm_kernels import can_pack, pack_weight, packed_linear
from pagedllm.layers.quantization import can_quantize, check_quantization, packed_linear_int8, quantize_and_pack

logger = logging.getLogger(__name__)

# Which part of a fused parameter a checkpoint tensor fills (None for unfused parameters).
ShardId = int | str | None


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor-parallel size "
                         f"({denominator}); choose a tensor_parallel_size that divides it")
    return numerator // denominator


def narrow_checked(loaded: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """``loaded.narrow`` with a readable error when the checkpoint tensor is too small."""
    if loaded.dim() <= dim or loaded.shape[dim] < start + length:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} has no slice "
                         f"[{start}:{start + length}] along dim {dim}")
    return loaded.narrow(dim, start, length)


def copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy (casting dtype/device) but never broadcast: a shape mismatch is a wrong checkpoint."""
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, "
                         f"the parameter expects {tuple(param.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    """y = x W^T + b on this rank's slice; subclasses define the slice."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # Per-output-channel scale of an int8 weight (``--quantization int8``), else None.
        self.weight_scale: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, quantization: str | None = None) -> None:
        """Re-lay out W for the device; ``quantization="int8"`` stores it as packed int8 with a
        per-output-channel scale instead (CPU float32 only; a weight the int8 kernel cannot take
        keeps its float layout, with a warning)."""
        check_quantization(quantization)
        if quantization == "int8" and can_quantize(self.weight.data):
            packed, scale = quantize_and_pack(self.weight.data)
            self.weight = nn.Parameter(packed, requires_grad=False)
            self.weight_scale = scale
            return
        if quantization == "int8":
            logger.warning("int8 quantization skipped for a %s weight of shape %s (needs the CPU kernels, "
                           "float32 and out_features %% 16 == 0); it stays in %s", self.weight.device.type,
                           tuple(self.weight.shape), self.weight.dtype)
        self.weight = cpu_gemm_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_scale)


# oneDNN's prepacked weights, tuned for this many rows (decode batches are small).
_ONEDNN_BATCH_HINT = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T + b, with W in any of the layouts ``cpu_gemm_weight`` returns, or packed int8 with
    its per-output-channel ``weight_scale`` (``quantization.quantize_and_pack``)."""
    if weight_scale is not None:  # int8 [out / 16, in, 16]
        return packed_linear_int8(x, weight, weight_scale, bias)
    if weight.dim() == 3:  # [out / 16, in, 16]: packed for our CPU kernel
        return packed_linear(x, weight, bias)
    if weight.layout == torch._mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def cpu_gemm_weight(param: nn.Parameter) -> nn.Parameter:
    """The fastest layout for W [out, in] in CPU GEMMs; unchanged elsewhere. It replaces W (same
    size, no second copy).

    Decode streams every weight once per step, so small-batch GEMMs are memory-bound. First
    choice: our kernel's packed layout [out / 16, in, 16] (``cpu_gemm_kernels``). Measured with
    30 layers of SmolLM-135M weights streamed (benchmarks/cpu_gemv.py, 2-core AMD Zen 4), against
    oneDNN on prepacked weights it runs 1.4-2x faster at 1-4 rows, 1.1-1.35x at 8-128, and level
    at prefill sizes (512-2048 rows). It needs float32, ``out`` divisible by 16 and the kernel
    (``PAGEDLLM_CPU_KERNELS=0`` turns it off). Otherwise oneDNN's prepacked weight (1.6x faster
    than ``F.linear`` at 1 row, 1.9x at 16, 1.35x at 64); without oneDNN, or with
    ``PAGEDLLM_ONEDNN=0``, W column-major (W^T contiguous), which streams sequentially in a plain
    row-major GEMM (1.3x at 1 row).
    """
    w = param.data
    if w.device.type != "cpu" or w.dim() != 2 or w.layout != torch.strided:
        return param
    if can_pack(w):
        return nn.Parameter(pack_weight(w), requires_grad=False)
    if w.dtype == torch.float32 and _onednn_enabled():
        packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _ONEDNN_BATCH_HINT)
        return nn.Parameter(packed, requires_grad=False)
    return nn.Parameter(w.t().contiguous().t(), requires_grad=False)


def _onednn_enabled() -> bool:
    return torch.backends.mkldnn.is_available() and envs.enabled("PAGEDLLM_ONEDNN")


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        copy_checked(param, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the result stays split (it feeds a row-parallel layer)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, get_tp_size(), "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        rows = param.shape[0]
        copy_checked(param, narrow_checked(loaded_weight, 0, self.tp_rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate_proj + up_proj).

    Each rank's weight is the concatenation of its slice of every projection, so the output
    splits back into per-projection chunks locally. ``shard_id`` is the projection's index.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = [divide(n, get_tp_size(), "output size") for n in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        shard = narrow_checked(loaded_weight, 0, self.tp_rank * size, size)
        copy_checked(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across ranks.

    With fewer KV heads than ranks (GQA/MQA at high TP) each KV head is replicated on
    ``tp_size // num_kv_heads`` ranks. ``num_heads`` / ``num_kv_heads`` are this rank's counts,
    which is what the attention layer must be built with.
    """

    _SHARD_IDS = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False) -> None:
        tp_size = get_tp_size()
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
        elif tp_size % total_num_kv_heads:
            raise ValueError(f"the tensor-parallel size ({tp_size}) exceeds num_key_value_heads "
                             f"({total_num_kv_heads}) but is not a multiple of it")
        else:
            self.num_kv_heads = 1
        self.kv_replicas = max(1, tp_size // total_num_kv_heads)
        self.head_dim = head_dim
        self.shard_sizes = (self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim)
        super().__init__(hidden_size, sum(self.shard_sizes) * tp_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        """``shard_id``: "q"/"k"/"v" or its index 0/1/2 (the order of the packed-modules mapping)."""
        index = self._SHARD_IDS.index(shard_id) if isinstance(shard_id, str) else shard_id
        if index not in (0, 1, 2):
            raise ValueError(f"shard_id must be one of q, k, v (or 0, 1, 2), got {shard_id!r}")
        size = self.shard_sizes[index]
        offset = sum(self.shard_sizes[:index])
        # Which copy of the heads this rank holds: q heads are never replicated, k/v may be.
        source = self.tp_rank if index == 0 else self.tp_rank // self.kv_replicas
        shard = narrow_checked(loaded_weight, 0, source * size, size)
        copy_checked(param.data.narrow(0, offset, size), shard)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(divide(input_size, get_tp_size(), "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if param.dim() == 1:  # the bias is not split
            copy_checked(param, loaded_weight)
            return
        cols = param.shape[1]
        copy_checked(param, narrow_checked(loaded_weight, 1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only rank 0 adds the bias so the all-reduce counts it once.
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None, self.weight_scale)
        return all_reduce(y)
