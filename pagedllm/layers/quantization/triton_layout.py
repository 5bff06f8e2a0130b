"""The int8 and int4 weights as the CUDA path holds them, and its Triton kernels
(``triton_dequant_gemm.py``), for the quant methods to choose at load (``int8.py``, ``int4.py``).

The CPU layouts are the C++ kernels' panels (16 outputs interleaved per k step, sized for a
vector register: ``cpu_gemm_kernels.pack_int8``, ``int4.pack_int4``); a GPU tile wants the opposite, N
contiguous at each k (coalesced loads across a warp), and no constraint on N. So on a CUDA device
the methods convert their integer weights once, at load, into:

- int8: Q^T int8 [K, N] and the per-output scale float32 [N];
- int4: int32 [K / 8, N] with input 8 r + j in bits 4 j of row r (GPTQ's own qweight layout, so
  a GPTQ checkpoint without act-order keeps its words), scales float32 [K / G, N], zero points
  uint8 [K / G, N], or none when every zero is 8 (symmetric checkpoints: GPTQ sym,
  compressed-tensors W4A16), which the kernel then takes as a constant.

The kernels import triton, which must see ``TRITON_INTERPRET`` first (tests); so they are imported
here only when a layer is converted, never at module import.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.config.device import triton_available

INT4_PER_WORD = 8
_SYMMETRIC_ZERO = 8

Gemm = Callable[..., torch.Tensor]


def triton_device(device: torch.device) -> bool:
    """Whether quantized linears on ``device`` hold the CUDA layouts and run the Triton kernels."""
    return device.type == "cuda" and triton_available()


def int8_gemm() -> Gemm:
    """``int8_gemm(x, weight [K, N], scale [N], bias)``."""
    from pagedllm.layers.quantization.triton_dequant_gemm import int8_gemm

    return int8_gemm


def int4_gemm() -> Gemm:
    """``int4_gemm(x, weight [K / 8, N], scale, zero | None, bias, group_size)``."""
    from pagedllm.layers.quantization.triton_dequant_gemm import int4_gemm

    return int4_gemm


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """Q [N, K] int8 -> Q^T [K, N], contiguous."""
    return q.t().contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] (0..15, K % 8 == 0) -> int32 [K / 8, N], input 8 r + j in bits 4 j of row r."""
    n, k = q.shape
    if k % INT4_PER_WORD:
        raise ValueError(f"int4 packing needs in_features % {INT4_PER_WORD} == 0, got {k}")
    by_word = q.t().to(torch.int32).reshape(k // INT4_PER_WORD, INT4_PER_WORD, n)
    words = torch.zeros((k // INT4_PER_WORD, n), dtype=torch.int32, device=q.device)
    for j in range(INT4_PER_WORD):
        words |= by_word[:, j] << (4 * j)  # bit 31 set for j = 7 >= 8: a negative int32, as GPTQ's
    return words


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``: q [N, K] uint8."""
    rows, n = words.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    nibbles = (words[:, None, :] >> shifts[None, :, None]) & 15  # [K / 8, 8, N]
    return nibbles.reshape(rows * INT4_PER_WORD, n).t().to(torch.uint8).contiguous()


def int4_group_params(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale float32 [K / G, N], zero uint8 [K / G, N] or None when all are 8) from the methods'
    scale and integral zero [N, K / G]."""
    zeros = None if bool((zero == _SYMMETRIC_ZERO).all()) else zero.t().to(torch.uint8).contiguous()
    return scale.t().float().contiguous(), zeros
