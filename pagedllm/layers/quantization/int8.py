"""Weight-only int8 for CPU decode (``--quantization int8``).

Batch-1 decode streams every weight once per step and the fp32 packed GEMM already runs at the
memory bandwidth, so the only way to go faster is fewer bytes: int8 weights with one float32 scale
per output channel (symmetric, W ~ Q * scale) are a quarter of the fp32 bytes. Activations stay
float32; the kernel (``csrc/cpu_gemm_int8.cpp``) widens the weights to fp32 in registers. The
checkpoint is float: the method quantizes after loading.

Measured on the SmolLM-135M-shaped dummy model (2-core Zen 4, one process, interleaved): a decode
step at batch 1 takes 10.9 ms instead of 20.4 (1.9x), at 16 rows 1.1x, at 64 rows 1.03x; the
30 layers' linears alone are ~2.9x faster at 1 row and level with fp32 at 256 rows. Widening the
weights costs vector work, so once the GEMM is compute-bound (large batches, prefill) int8 buys
memory, not speed. The linears: 106 MB instead of 425 (measured with the LM head still float32).

On a CUDA device the method holds Q^T [K, N] instead and runs the Triton kernel
(``triton_layout.py``): any out_features, float16 / bfloat16 / float32 activations.

The LM head (113 MB here in float32) is held in int8 groups of 32 (``int8_groups``: a scale per 32
inputs, not per row, so its error is Q8_0's, far below a per-channel head's); the embedding
lookups keep the float32 table.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable
from functools import lru_cache
from typing import Protocol, cast

import torch
from torch import nn

from pagedllm.layers.cpu_gemm_kernels import pack_int8, packable
from pagedllm.layers.cpu_kernels import cpu_ops
from pagedllm.layers.quantization import triton_layout
from pagedllm.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizesOnLoad,
    WeightLoader,
    create_dense_weight,
)
from pagedllm.layers.quantization.int8_groups import GroupedInt8HeadMethod
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod

logger = logging.getLogger(__name__)

# Symmetric range: -127..127 (not -128) so that q and -q are both representable.
_QMAX = 127

PackedLinearInt8 = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@lru_cache(maxsize=1)
def load_int8_gemm() -> PackedLinearInt8 | None:
    """``packed_linear_int8(x, packed, scale, bias)`` built for this CPU, or None when the CPU
    kernels are disabled (``PAGEDLLM_CPU_KERNELS=0``) or the build failed."""
    ops = cpu_ops()
    return None if ops is None else ops.packed_linear_int8.default


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] float -> (Q [out, in] int8, scale [out] float32) with W ~ Q * scale[:, None]:
    scale = max|w| / 127 per output row, Q = round(W / scale) in [-127, 127]. The error of each
    weight is at most scale / 2. An all-zero row gets scale 1 (Q = 0), not a division by zero."""
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise ValueError(f"int8 quantization takes a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scale.contiguous()


def can_quantize(w: torch.Tensor) -> bool:
    """Whether ``w`` [out, in] can use an int8 kernel: on CUDA the Triton one (with triton
    installed), on CPU the C++ one (``packable`` and the kernel built)."""
    if triton_layout.triton_device(w.device):
        return w.dim() == 2
    return packable(w) and load_int8_gemm() is not None


def quantize_and_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int8 [out / 16, in, 16], scale [out]) for the kernel."""
    q, scale = quantize_per_channel(w)
    return pack_int8(q), scale


class Int8Layer(Protocol):
    """The attributes of a layer this method owns (``nn.Module`` types them as tensor or module)."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    quant_method: LinearMethodBase


def _not_quantized_yet(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    raise RuntimeError("an int8 layer runs only after its quant_method.process_weights_after_loading")


class PerChannelInt8Method(QuantizesOnLoad):
    """What the int8 formats share: the float checkpoint weight is loaded as is, then quantized
    per output channel (``quantize_per_channel``) by ``quantize``, once. A weight ``can_take``
    refuses (not CPU float32, out % 16, no kernel) keeps a float layout: the layer's method becomes
    the unquantized one, with a warning naming ``requirements``."""

    format_name = ""
    requirements = ""

    def __init__(self) -> None:
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
        layer.register_buffer("weight_scale", None, persistent=False)

    @abstractmethod
    def store(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Replace ``layer.weight`` by the format's layout of Q [out, in] int8 (W ~ Q * scale[:, None])
        and set its buffers; pre-quantized checkpoints arrive here with their own Q and scale."""

    def quantize(self, layer: nn.Module, w: torch.Tensor) -> None:
        """Quantize the float weight ``w`` per output channel and ``store`` it."""
        self.store(layer, *quantize_per_channel(w))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.quantized:
            return
        typed = cast(Int8Layer, layer)
        w = typed.weight.data
        if not self.can_take(w):
            logger.warning(
                "%s quantization skipped for a %s weight of shape %s (needs %s); it stays in %s",
                self.format_name,
                w.device.type,
                tuple(w.shape),
                self.requirements,
                w.dtype,
            )
            typed.quant_method = UnquantizedLinearMethod()
            typed.quant_method.process_weights_after_loading(layer)
            return
        self.quantize(layer, w)
        self.quantized = True


class Int8LinearMethod(PerChannelInt8Method):
    """Loads the float checkpoint weight, then stores it as packed int8 with a per-output-channel
    scale (buffer ``weight_scale``)."""

    format_name = "int8"
    requirements = "CUDA with triton, or the CPU kernels, float32 and out_features % 16 == 0"

    def __init__(self) -> None:
        super().__init__()
        self._kernel: PackedLinearInt8 = _not_quantized_yet  # the int8 GEMM once the weight is quantized

    def can_take(self, w: torch.Tensor) -> bool:
        return can_quantize(w)

    def store(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
        typed = cast(Int8Layer, layer)
        on_gpu = triton_layout.triton_device(q.device)
        packed = triton_layout.pack_int8(q) if on_gpu else pack_int8(q)
        typed.weight, typed.weight_scale = nn.Parameter(packed, requires_grad=False), scale.float()
        kernel = triton_layout.int8_gemm() if on_gpu else load_int8_gemm()
        assert kernel is not None, "can_quantize checked that the kernel built"
        self._kernel = kernel

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        typed = cast(Int8Layer, layer)
        return self._kernel(x, typed.weight, typed.weight_scale, bias)


class Int8Config(QuantizationConfig):
    """Weight-only int8 for the transformer's linears; the LM head in int8 groups of 32 (``int8_groups``)."""

    name = "int8"
    quantize_on_load = Int8LinearMethod

    def get_linear_method(self) -> LinearMethodBase:
        return Int8LinearMethod()

    def get_lm_head_method(self) -> LinearMethodBase:
        return GroupedInt8HeadMethod()
