"""W8A8 for compute-bound CPU steps (``--quantization w8a8``): int8 weights and int8 activations.

From ~16 rows (decode batches, prefill) the fp32 GEMM is bound by its multiply-adds, not by
streaming the weights, so weight-only int8 stops helping there (``int8.py``). Quantizing the
activations too lets the kernel (``csrc/cpu_gemm_w8a8.cpp``) use the 4-byte int8 dot products
(AVX-512 VNNI, AVX-VNNI, Arm dotprod; an exact vpmaddubsw path without them), 4x the
multiply-adds of an fp32 FMA per instruction, with exact int32 sums:

    y[m, n] = (sum_k qx[m, k] qw[n, k]) * sx[m] * sw[n] + b[n]

Weights: per output channel, symmetric (``quantize_per_channel``, shared with int8), quantized
after loading the float checkpoint. Activations: per token, symmetric, dynamic (each call, inside
the kernel): sx = max|x_m| / 127, qx = round(x * 127 / max|x_m|) (``quantize_per_token`` is the
same formula in torch, the tests' reference). Each activation's error is at most sx / 2.

The LM head is W8A8 too (this method, quantized after loading from the float or tied table; the
embedding lookups keep the float32 table), as llama.cpp runs a quantized model's head on int8
activations: from 16 rows it is a quarter of a SmolLM2-sized step's multiply-adds, and weight-only
int8 groups (the weight-only formats' head, ``int8_groups``) run there at float32's rate or below
(``docs/benchmarks.md`` has both, and the logits' error).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.cpu_gemm_kernels import PANEL, packable
from pagedllm.layers.cpu_kernels import cpu_ops
from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig
from pagedllm.layers.quantization.int8 import PerChannelInt8Method

_QMAX = 127
# The kernel's int32 sums of (q + 128) * w stay exact up to this many inputs.
MAX_IN_FEATURES = 65536
# The unsigned-activation dot products (VNNI) add 128 * sum_k w[n, k], which the kernel subtracts.
_UNSIGNED_OFFSET = 128

LinearW8A8 = Callable[..., torch.Tensor]


@lru_cache(maxsize=1)
def load_w8a8_gemm() -> LinearW8A8 | None:
    """``linear_w8a8(x, packed, w_scale, w_comp, bias, path=0)`` of the selected build, or None
    when the CPU kernels are disabled or the build failed."""
    ops = cpu_ops()
    return None if ops is None else ops.linear_w8a8.default


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float32 -> (q [..., K] int8, scale [...] float32), x ~ q * scale[..., None]: the
    kernel's formula (an all-zero row gets scale 1 and q = 0)."""
    if not x.dtype == torch.float32:
        raise ValueError(f"w8a8 quantizes float32 activations, got {x.dtype}")
    amax = x.abs().amax(dim=-1)
    # Tensor / tensor: one IEEE division as in the kernel (``127 / amax`` with a Python number is
    # reciprocal(amax) * 127 in torch, two roundings, and moves ties of x * inv).
    qmax = torch.full_like(amax, _QMAX)
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = torch.round(x * inv[..., None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scale


def pack_w8a8(q: torch.Tensor) -> torch.Tensor:
    """Q [N, K] int8 -> [N / 16, ceil(K / 4), 16, 4] with K zero-padded: one k4 step of a panel
    of 16 outputs is 64 bytes, each output's 4 consecutive inputs adjacent (one int32 lane of the
    dot product instructions)."""
    n, k = q.shape
    if n % PANEL:
        raise ValueError(f"w8a8 packing needs out_features % {PANEL} == 0, got {n}")
    k4 = -(-k // 4)
    padded = F.pad(q, (0, 4 * k4 - k))
    return padded.reshape(n // PANEL, PANEL, k4, 4).permute(0, 2, 1, 3).contiguous()


def unpack_w8a8(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The inverse of ``pack_w8a8`` (a new [N, K] tensor)."""
    panels, k4, _, _ = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(panels * PANEL, 4 * k4)[:, :in_features].contiguous()


def compensation(q: torch.Tensor) -> torch.Tensor:
    """128 * sum_k Q[n, k] as int32 [N]: what unsigned activations (q + 128) add to each output."""
    return (q.sum(dim=1, dtype=torch.int32) * _UNSIGNED_OFFSET).contiguous()


def can_quantize(w: torch.Tensor) -> bool:
    """Whether ``w`` [out, in] can use the W8A8 kernel: ``packable``, in <= 65536, kernel built."""
    return packable(w) and w.shape[1] <= MAX_IN_FEATURES and load_w8a8_gemm() is not None


class _W8A8Layer(Protocol):
    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_comp: torch.Tensor


def _not_quantized_yet(*args: object) -> torch.Tensor:
    raise RuntimeError("a w8a8 layer runs only after its quant_method.process_weights_after_loading")


class W8A8LinearMethod(PerChannelInt8Method):
    """Packed int8 weights (``pack_w8a8``) with buffers ``weight_scale`` [out] and
    ``weight_comp`` [out] (``compensation``); activations quantized per token by the kernel."""

    format_name = "w8a8"
    requirements = f"the CPU kernels, float32, out_features % 16 == 0 and in_features <= {MAX_IN_FEATURES}"

    def __init__(self) -> None:
        super().__init__()
        self._kernel: LinearW8A8 = _not_quantized_yet

    def can_take(self, w: torch.Tensor) -> bool:
        return can_quantize(w)

    def store(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
        typed = cast(_W8A8Layer, layer)
        # The maddubs paths negate a weight where the activation is negative, so |Q| <= 127: a
        # checkpoint's -128 (compressed-tensors' symmetric scale is absmax / 127.5) becomes -127,
        # one step off on that weight alone, rather than requantizing the whole row.
        q = q.clamp(min=-127)
        typed.weight_scale = scale
        layer.register_buffer("weight_comp", compensation(q), persistent=False)
        typed.weight = nn.Parameter(pack_w8a8(q), requires_grad=False)
        kernel = load_w8a8_gemm()
        assert kernel is not None, "can_quantize checked that the kernel built"
        self._kernel = kernel

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        typed = cast(_W8A8Layer, layer)
        return self._kernel(x, typed.weight, typed.weight_scale, typed.weight_comp, bias)


class W8A8Config(QuantizationConfig):
    """W8A8 for the transformer's linears and the LM head."""

    name = "w8a8"
    quantize_on_load = W8A8LinearMethod

    def get_linear_method(self) -> LinearMethodBase:
        return W8A8LinearMethod()

    def get_lm_head_method(self) -> LinearMethodBase:
        return W8A8LinearMethod()
