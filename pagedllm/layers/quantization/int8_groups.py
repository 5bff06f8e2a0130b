"""The LM head of the quantized formats in int8 groups of 32 (GGUF's Q8_0 in our kernel's layout).

Batch-1 decode streams every weight once per step, and the LM head is a large share of them: at
SmolLM2-135M's shape (vocab 49152 x hidden 576) a float32 head is 113 MB, more than the int4
transformer's 66 MB. llama.cpp keeps a quantized file's output layer in Q8_0 (28 MB). So the
formats that quantize anyway (``int8``, ``int4``, ``w4a8``; ``w8a8`` runs its head as W8A8) give
the head this method (a GGUF file's block-quantized head is held from its own blocks instead,
``gguf.GGUFHeadMethod``, and comes here only in a type without an integer form): symmetric int8 with one scale per output row and
group of 32 inputs (a float16 value, as Q8_0 stores it; held in float16: ``pack_group_params``), W = q * s, q in -127..127 (``quantize_groups``), run by the group-wise kernel
(``csrc/cpu_gemm_grouped.cpp``, ``packed_linear_int8_grouped``) on the per-channel int8 kernel's
packed layout (``cpu_gemm_kernels.pack_int8``) with the int4 kernel's per-group scales
(``cpu_gemm_kernels.pack_groups``).

Accuracy: each weight's error is at most s / 2 = max|w| of its group / 254, much finer than a
per-channel scale (max over the whole row). A GGUF Q8_0 head, dequantized by the loader and
quantized here again, comes back as the file's own integers and scales (the largest value of a
block is 127 d exactly, so d and every q are recovered; d up to float32 rounding).

The float weight loads as usual (tied models: the embedding's table, which lookups keep using)
and is quantized once after loading; the head holds only the packed copy. Where the kernel
cannot run (no CPU kernels, not float32 on CPU, rows % 16, inputs % 32) the head stays float.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import lru_cache
from typing import Any, cast

import torch
from torch import nn

from pagedllm.layers.cpu_gemm_kernels import PANEL, fp16_scales, pack_group_params, pack_int8
from pagedllm.layers.cpu_kernels import cpu_ops
from pagedllm.layers.quantization.base import LinearMethodBase, WeightLoader, create_dense_weight
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod

logger = logging.getLogger(__name__)

GROUP = 32
_QMAX = 127
_CHUNK_ROWS = 4096  # rows quantized at a time (a 128k-vocab head is not copied in float32 at once)

GroupedInt8Gemm = Callable[..., torch.Tensor]


@lru_cache(maxsize=1)
def load_grouped_int8_gemm() -> GroupedInt8Gemm | None:
    """``packed_linear_int8_grouped(x, packed, scale, bias, group_size, zero=None)`` of the selected build,
    or None when the CPU kernels are disabled or the build failed."""
    ops = cpu_ops()
    return None if ops is None else ops.packed_linear_int8_grouped.default


def quantize_groups(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] float -> (q [N, K] int8 in -127..127, scale [N, K / G] float32), W ~ q * scale
    per group of G inputs (Q8_0's rule: scale = max|w| / 127, rounded to the nearest float16 as
    Q8_0 stores it (``fp16_scales``; half the scale bytes in the kernel), q = round(w / scale):
    the largest |w| of a group lands within 127 * 2^-11 of 127 and rounds to it). A group of
    zeros gets scale 0 and q 0."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, k // group, dtype=torch.float32)
    chunks = range(0, n, _CHUNK_ROWS)  # float temporaries of a chunk only, not of the whole head
    for start in chunks:
        rows = w[start : start + _CHUNK_ROWS].float().reshape(-1, k // group, group)
        scale[start : start + _CHUNK_ROWS] = rows.abs().amax(dim=2) / _QMAX
    scale = fp16_scales(scale)
    for start in chunks:
        groups = w[start : start + _CHUNK_ROWS].float().reshape(-1, k // group, group)
        s = scale[start : start + _CHUNK_ROWS]
        safe = torch.where(s > 0, s, torch.ones_like(s))
        q[start : start + _CHUNK_ROWS] = torch.round(groups / safe[..., None]).clamp_(-_QMAX, _QMAX).reshape(-1, k)
    return q, scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> torch.Tensor:
    """q * scale, or (q - zero) * scale, as float32 [N, K] (the kernel's weights, the tests' reference)."""
    group = q.shape[1] // scale.shape[1]
    values = q.float() if zero is None else q.float() - zero.repeat_interleave(group, dim=1)
    return values * scale.repeat_interleave(group, dim=1)


def can_take(w: torch.Tensor) -> bool:
    """Whether the group-wise int8 kernel takes the float weight ``w`` [out, in]."""
    return (
        w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.dim() == 2
        and w.shape[0] % PANEL == 0
        and w.shape[1] % GROUP == 0
        and load_grouped_int8_gemm() is not None
    )


def _not_loaded_yet(*args: object) -> torch.Tensor:
    raise RuntimeError("an int8-group layer runs only after its quant_method.process_weights_after_loading")


class GroupedInt8Method(LinearMethodBase):
    """A layer held as int8 groups (W = q * s, a scale per output and G inputs; W = (q - z) * s
    with a zero point per group too) on the group-wise op; ``store`` takes q, the scales and the
    zero points if any (a GGUF file's blocks as they are, or a quantized head)."""

    def __init__(self) -> None:
        self._kernel: GroupedInt8Gemm = _not_loaded_yet
        self.group_size = GROUP
        self.quantized = False

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        create_dense_weight(layer, input_size, output_sizes, params_dtype, weight_loader)

    def store(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> None:
        """Hold q [N, K] int8, scale (and zero) [N, K / G] float32 packed for the op (``can_store``
        said yes; in float16 where exact: ``pack_group_params``)."""
        # A new parameter: a tied embedding keeps its float table for lookups.
        layer.weight = nn.Parameter(pack_int8(q), requires_grad=False)
        packed_scale, packed_zero = pack_group_params(scale, zero)
        layer.register_buffer("weight_scale", packed_scale, persistent=False)
        layer.register_buffer("weight_zero", packed_zero, persistent=False)
        kernel = load_grouped_int8_gemm()
        assert kernel is not None, "can_store checked that the kernel built"
        self._kernel, self.group_size, self.quantized = kernel, q.shape[1] // scale.shape[1], True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._kernel(x, layer.weight, layer.weight_scale, bias, self.group_size, layer.weight_zero)


def can_store(q: torch.Tensor) -> bool:
    """Whether the group-wise int8 op takes a layer of q's shape (on CPU, with the kernels built)."""
    return q.device.type == "cpu" and q.shape[0] % PANEL == 0 and load_grouped_int8_gemm() is not None


class GroupedInt8HeadMethod(GroupedInt8Method):
    """An LM head loaded as float (or tied to the embedding), then held as int8 groups of 32."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.quantized:
            return
        w = cast(torch.Tensor, layer.weight).data
        if not can_take(w):
            logger.info(
                "the LM head (%s %s on %s) stays float: int8 groups need the CPU kernels, float32, "
                "rows %% %d == 0 and inputs %% %d == 0",
                tuple(w.shape),
                w.dtype,
                w.device.type,
                PANEL,
                GROUP,
            )
            method = UnquantizedLinearMethod()
            cast(Any, layer).quant_method = method
            method.process_weights_after_loading(layer)
            return
        self.store(layer, *quantize_groups(w))
