"""Weight-only int8 and group-wise int4 GEMMs as Triton kernels (the CUDA path of ``int8.py`` and
``int4.py``), with the C++ ops' signatures: ``int8_gemm(x, weight, scale, bias)`` and
``int4_gemm(x, weight, scale, zero, bias, group_size)``.

Written for CUDA; they also run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is imported), which is how they are tested without a GPU. The weights are in
the CUDA layouts of ``triton_layout.py`` (both K-major, so a tile's loads run along N):

- int8: ``weight`` int8 [K, N], ``scale`` float32 [N]: y = (x @ Q) * scale, the scale applied
  once to the fp32 sums.
- int4: ``weight`` int32 [K / 8, N] (GPTQ's qweight: input 8 r + j in bits 4 j of row r),
  ``scale`` float32 [K / G, N], ``zero`` uint8 [K / G, N] or None (symmetric: z = 8); each tile
  is widened to (q - z) * s in fp32 before the dot, as a group's scale varies along K.

One kernel per format covers decode and prefill: grid (M / BLOCK_M, N / BLOCK_N), a K loop with
fp32 accumulation, the tile chosen by M (``tile_for``). A float16 / bfloat16 tile is dotted in its
own dtype (the weights rounded to it, as a dequantize-then-matmul in that dtype would), a float32
one in IEEE fp32 (not TF32). Bias is added to the fp32 sums; the output has x's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INT4_PER_WORD = 8


@dataclass(frozen=True)
class Tile:
    """A launch configuration: the program's block of the output and the K step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# By rows M (upper bounds). Decode (M <= 16) is bound by streaming the weights: narrow N blocks give
# more programs to spread them over the SMs, long K steps more bytes in flight. Prefill tiles are
# square-ish for reuse. Untuned first choices: benchmarks/gpu/quant_gemm.py times them on a GPU.
TILES = (
    (16, Tile(16, 32, 128, 4, 4)),
    (64, Tile(32, 64, 64, 4, 4)),
    (256, Tile(64, 128, 64, 4, 3)),
    (1 << 62, Tile(128, 128, 32, 8, 3)),
)


def tile_for(m: int) -> Tile:
    """The tile for an M-row activation."""
    return next(tile for bound, tile in TILES if m <= bound)


# How a tile is dotted (the DOT constexpr): in x's dtype (float16 / bfloat16), in IEEE fp32
# (float32 x: not TF32), or with the weights rounded to x's dtype and both widened to fp32 (bf16
# under the interpreter, whose tl.dot multiplies bf16 as raw uint16 bits).
DOT_NATIVE, DOT_IEEE, DOT_UPCAST = 0, 1, 2


@triton.jit
def _dot(x, w, DOT: tl.constexpr):
    """x [BM, BK] @ w [BK, BN] with fp32 sums (see DOT_NATIVE)."""
    if DOT == 1:
        return tl.dot(x, w.to(tl.float32), input_precision="ieee")
    if DOT == 2:
        return tl.dot(x.to(tl.float32), w.to(tl.float32).to(x.dtype).to(tl.float32), input_precision="ieee")
    return tl.dot(x, w.to(x.dtype))


@triton.jit
def _output_block(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output rows and columns, and its fp32 accumulator."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


@triton.jit
def _load_x(x_ptr, stride_xm, rm, k, M, K):
    return tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)


@triton.jit
def _store_y(y_ptr, acc, b_ptr, stride_ym, rm, rn, M, N, HAS_BIAS: tl.constexpr):
    n_ok = rn < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out, mask=(rm[:, None] < M) & n_ok[None, :])


@triton.jit
def _int8_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm, rn, acc = _output_block(BLOCK_M, BLOCK_N)
    n_ok = rn < N
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = _load_x(x_ptr, stride_xm, rm, k, M, K)
        q = tl.load(w_ptr + k[:, None] * N + rn[None, :], mask=(k[:, None] < K) & n_ok[None, :], other=0)
        acc += _dot(x, q, DOT)
    acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    _store_y(y_ptr, acc, b_ptr, stride_ym, rm, rn, M, N, HAS_BIAS)


@triton.jit
def _int4_group_params(s_ptr, z_ptr, g_rows, rn, ok, N, HAS_ZERO: tl.constexpr):
    """(scale, zero) of the groups ``g_rows`` (a [1] or [BK, 1] index) for the columns ``rn``."""
    s = tl.load(s_ptr + g_rows * N + rn[None, :], mask=ok, other=0.0)
    if HAS_ZERO:
        z = tl.load(z_ptr + g_rows * N + rn[None, :], mask=ok, other=0).to(tl.float32)
    else:
        z = tl.full(s.shape, 8.0, tl.float32)
    return s, z


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm, rn, acc = _output_block(BLOCK_M, BLOCK_N)
    n_ok = rn < N
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ok = (k[:, None] < K) & n_ok[None, :]
        x = _load_x(x_ptr, stride_xm, rm, k, M, K)
        words = tl.load(w_ptr + (k[:, None] // 8) * N + rn[None, :], mask=ok, other=0)
        q = ((words >> ((k[:, None] % 8) * 4)) & 15).to(tl.float32)
        if GROUP % BLOCK_K == 0:  # the step lies in one group: one row of scales and zeros
            s, z = _int4_group_params(s_ptr, z_ptr, k0 // GROUP, rn, n_ok[None, :], N, HAS_ZERO)
        else:
            s, z = _int4_group_params(s_ptr, z_ptr, (k // GROUP)[:, None], rn, ok, N, HAS_ZERO)
        acc += _dot(x, (q - z) * s, DOT)
    _store_y(y_ptr, acc, b_ptr, stride_ym, rm, rn, M, N, HAS_BIAS)


def interpreting() -> bool:
    """Whether these kernels were decorated for Triton's CPU interpreter."""
    return type(_int8_gemm_kernel).__name__ == "InterpretedFunction"


def _dot_mode(dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return DOT_IEEE
    return DOT_UPCAST if dtype == torch.bfloat16 and interpreting() else DOT_NATIVE


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as a 2-D [M, K] with unit stride along K (a copy only when it has none)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(
    kernel, x: torch.Tensor, n: int, tile: Tile | None, args: tuple, block_k: int | None = None, **constexprs: object
) -> torch.Tensor:
    """Run ``kernel`` over x [..., K] -> y [..., n] in x's dtype; ``args`` follow x's pointer."""
    rows = _as_rows(x)
    m, k = rows.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        t = tile or tile_for(m)
        grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n))
        kernel[grid](
            rows,
            *args,
            y,
            m,
            n,
            k,
            rows.stride(0),
            y.stride(0),
            DOT=_dot_mode(x.dtype),
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            BLOCK_K=block_k or t.block_k,
            num_warps=t.num_warps,
            num_stages=t.num_stages,
            **constexprs,
        )
    return y.reshape(*x.shape[:-1], n)


def int8_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, tile: Tile | None = None
) -> torch.Tensor:
    """``x [..., K] @ (weight * scale)`` (+ bias) with ``weight`` int8 [K, N], ``scale`` [N]."""
    n = weight.shape[1]
    return _launch(_int8_gemm_kernel, x, n, tile, (weight, scale, _or(bias, scale)), HAS_BIAS=bias is not None)


def int4_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
    tile: Tile | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W`` (+ bias), W[k, n] = (q - zero) * scale of k's group, with ``weight``
    int32 [K / 8, N], ``scale`` float32 and ``zero`` uint8 [K / G, N] (None: every zero is 8)."""
    n = weight.shape[1]
    m = x.numel() // max(x.shape[-1], 1)
    block_k = int4_block_k((tile or tile_for(m)).block_k, group_size)
    args = (weight, scale, _or(zero, scale), _or(bias, scale))
    constexprs = {"GROUP": group_size, "HAS_ZERO": zero is not None, "HAS_BIAS": bias is not None}
    return _launch(_int4_gemm_kernel, x, n, tile, args, block_k=block_k, **constexprs)


def int4_block_k(block_k: int, group_size: int) -> int:
    """The tile's K step (a power of two) cut to the largest one, from 16 up, that divides the
    group: then each step lies in one group and reads one row of scales and zeros. A group no
    such step divides keeps the tile's (each input then finds its own group)."""
    step = block_k
    while step >= 16 and group_size % step:
        step //= 2
    return step if step >= 16 else block_k


def _or(t: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """A pointer argument the kernel does not read when ``t`` is None (its HAS_ flag is off)."""
    return stand_in if t is None else t
