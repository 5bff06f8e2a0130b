"""Unquantized weights: the checkpoint's float matrix, laid out once for the device's fastest GEMM.

Decode streams every weight once per step, so small-batch GEMMs are memory-bound and the layout
decides the speed. On CPU, :func:`choose_layout` picks, in order (measured with 30 layers of
SmolLM-135M weights streamed, ``benchmarks/cpu_gemv.py``, 2-core AMD Zen 4):

1. ``PACKED``: our kernel's panels [out / 16, in, 16] (``cpu_gemm_kernels``); against oneDNN on
   prepacked weights 1.4-2x faster at 1-4 rows, 1.1-1.35x at 8-128, level at prefill sizes
   (512-2048 rows). Needs float32, ``out`` divisible by 16 and the kernel built
   (``PAGEDLLM_CPU_KERNELS=0`` / ``PAGEDLLM_CPU_GEMM=0`` turn it off).
2. ``ONEDNN``: oneDNN's prepacked weight (1.6x faster than ``F.linear`` at 1 row, 1.9x at 16,
   1.35x at 64); float32 with oneDNN available, unless ``PAGEDLLM_ONEDNN=0``.
3. ``PACKED_16``: a bfloat16 / float16 model's weights (``--dtype``) in the same panels, in their
   own dtype, widened to float32 in registers (``packed_linear_16``): half the bytes a decode step
   reads. Where the CPU has no native dot products of the dtype, torch computes 16-bit matmuls
   through conversions: with oneDNN held to AVX2, SmolLM's bfloat16 linears took 3.2-5.1x the
   packed kernel's time from 8 to 512 rows (level at one row), float16 4.7-5.0x on Zen 4 (no FP16).
   Where it has them (AVX512-BF16, AMX, AVX512-FP16, Arm BF16 / FP16), ``PACKED_16_SPLIT``: the
   packed kernel below ``NATIVE_16_BIT_ROWS`` rows (2x oneDNN at one row, 1.4x at 16), oneDNN on
   a copy unpacked for the call from there (prefill at 0.9x oneDNN on the plain weight).
4. ``COLUMN_MAJOR``: W^T contiguous, which streams sequentially in a plain row-major GEMM (1.3x
   at 1 row).

Elsewhere (CUDA) the weight stays as loaded and ``F.linear`` runs (``PLAIN``). The conversion
replaces W (same size, no second copy); the layout's kernel is bound to the method, so ``apply``
tests nothing per call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import cpu_info, envs
from pagedllm.layers.cpu_gemm_kernels import (
    can_pack,
    can_pack_16,
    load_cpu_gemm,
    load_cpu_gemm_16,
    pack_weight,
    unpack_weight,
)
from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig, WeightLoader, create_dense_weight

LinearKernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

# oneDNN's prepacked weights, tuned for this many rows (decode batches are small).
_ONEDNN_BATCH_HINT = 16


@dataclass(frozen=True)
class WeightLayout:
    """How a float weight [out, in] is stored, and the GEMM that reads that storage."""

    name: str
    convert: Callable[[torch.Tensor], torch.Tensor]
    kernel: Callable[[], LinearKernel]  # resolved once, when the layout is chosen


def _onednn_reorder(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _ONEDNN_BATCH_HINT)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _required(kernel: LinearKernel | None, layout: str) -> LinearKernel:
    assert kernel is not None, f"the {layout} layout is chosen only when its kernel built"
    return kernel


def _packed_kernel() -> LinearKernel:
    return _required(load_cpu_gemm(), "packed")


def _packed_16_kernel() -> LinearKernel:
    return _required(load_cpu_gemm_16(), "16-bit packed")


# Rows from which a CPU with native 16-bit dot products runs a layer faster through oneDNN's own
# GEMM on a plain copy of the weight, unpacked for the call (Zen 4, AVX512-BF16, SmolLM's 24
# linears: 64 rows 14.9 ms unpacked vs 13.8 packed, 128 rows 21.7 vs 27.7, 512 rows 62.9 vs 109;
# from 1 to 32 rows the packed kernel is 2.0-1.1x faster than oneDNN on the plain weight).
NATIVE_16_BIT_ROWS = 96


def _packed_16_split_kernel() -> LinearKernel:
    packed = _packed_16_kernel()

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.numel() >= NATIVE_16_BIT_ROWS * x.shape[-1]:
            return F.linear(x, unpack_weight(weight), bias)
        return packed(x, weight, bias)

    return linear


PLAIN = WeightLayout("plain", lambda w: w, lambda: F.linear)
PACKED = WeightLayout("packed", pack_weight, _packed_kernel)
PACKED_16 = WeightLayout("packed_16", pack_weight, _packed_16_kernel)
PACKED_16_SPLIT = WeightLayout("packed_16_split", pack_weight, _packed_16_split_kernel)
ONEDNN = WeightLayout("onednn", _onednn_reorder, lambda: _onednn_linear)
COLUMN_MAJOR = WeightLayout("column_major", lambda w: w.t().contiguous().t(), lambda: F.linear)


def choose_layout(w: torch.Tensor) -> WeightLayout:
    """The fastest layout for the plain weight ``w`` [out, in] on its device (see the module doc)."""
    if w.device.type != "cpu" or w.dim() != 2 or w.layout != torch.strided:
        return PLAIN
    if can_pack(w):
        return PACKED
    if can_pack_16(w):
        return PACKED_16_SPLIT if cpu_info.native_16_bit(w.dtype) else PACKED_16
    if w.dtype == torch.float32 and _onednn_enabled():
        return ONEDNN
    return COLUMN_MAJOR


def _onednn_enabled() -> bool:
    return torch.backends.mkldnn.is_available() and envs.enabled("PAGEDLLM_ONEDNN")


class UnquantizedLinearMethod(LinearMethodBase):
    """Float weights; after loading, in the layout :func:`choose_layout` picks for the layer."""

    def __init__(self) -> None:
        self.layout: WeightLayout | None = None  # None until the weights are processed
        self._kernel: LinearKernel = F.linear  # the checkpoint layout works before processing

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        create_dense_weight(layer, input_size, output_sizes, params_dtype, weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.layout is not None:  # already converted: the weight is no longer the plain matrix
            return
        weight = cast(torch.Tensor, layer.weight)  # create_weights registered it
        self.layout = choose_layout(weight.data)
        if self.layout is not PLAIN:
            layer.weight = nn.Parameter(self.layout.convert(weight.data), requires_grad=False)
        self._kernel = self.layout.kernel()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._kernel(x, cast(torch.Tensor, layer.weight), bias)


class UnquantizedConfig(QuantizationConfig):
    """No quantization (``--quantization`` unset)."""

    name = "none"

    def get_linear_method(self) -> LinearMethodBase:
        return UnquantizedLinearMethod()

    def get_lm_head_method(self) -> LinearMethodBase:
        return UnquantizedLinearMethod()
