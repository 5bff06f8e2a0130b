"""The JIT-built CPU GEMM kernel (``csrc/cpu_gemm.cpp``) and the packed weight layouts of the CPU
GEMM kernels (fp32 panels here; the int8 interleave and per-group values the quantized formats share).

Decode at a few rows is bound by streaming the weights, and neither ``F.linear`` nor oneDNN's
prepacked GEMV gets near the machine's read bandwidth there; this kernel does, and on the same
packed layout it also matches or beats oneDNN from 16 rows up to prefill sizes
(``python -m benchmarks.cpu_gemv``), so one copy of each weight serves every batch size.

It lives in the one CPU kernel library (``layers/cpu_kernels.py``). ``PAGEDLLM_CPU_KERNELS=0``
turns it off (the other kernels too; ``PAGEDLLM_CPU_GEMM=0`` only this one); without it the
linears keep the oneDNN / torch path.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

from pagedllm.layers.cpu_kernels import cpu_ops, kernels_enabled

# Outputs per packed panel (kLanes in the kernel): one AVX-512 vector of float32, two AVX2, four NEON.
PANEL = 16
# Output rows per interleaved group of the int8 layouts (``pack_int8``): 4 panels of 16.
INT8_GROUP_ROWS = 4 * PANEL

PackedLinear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _packed_op(name: str) -> PackedLinear | None:
    """The kernel library's op ``name`` (a packed linear), or None when the kernels are off
    (``PAGEDLLM_CPU_GEMM=0`` turns off only the packed GEMMs, for A/B runs against oneDNN) or the
    build failed."""
    ops = cpu_ops() if kernels_enabled("PAGEDLLM_CPU_GEMM") else None
    return None if ops is None else getattr(ops, name).default


@lru_cache(maxsize=1)
def load_cpu_gemm() -> PackedLinear | None:
    """``packed_linear(x, packed, bias)`` built for this CPU, or None (see ``_packed_op``)."""
    return _packed_op("packed_linear")


@lru_cache(maxsize=1)
def load_cpu_gemm_16() -> PackedLinear | None:
    """``packed_linear_16(x, packed, bias)`` (bfloat16 / float16 panels, result in x's dtype), or
    None as for ``load_cpu_gemm``."""
    return _packed_op("packed_linear_16")


# Weight dtypes of the 16-bit packed layout (``packed_linear_16``).
PACKED_16_DTYPES = (torch.bfloat16, torch.float16)


def packable(w: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether ``w`` [out, in] fits the packed panel layouts (fp32 and int8; 16-bit with
    ``dtypes=PACKED_16_DTYPES``): a plain CPU matrix of one of ``dtypes`` with out % 16 == 0, so
    the packed shape keeps ``out``."""
    return (
        w.device.type == "cpu"
        and w.dtype in dtypes
        and w.dim() == 2
        and w.layout == torch.strided
        and w.shape[0] % PANEL == 0
    )


def can_pack(w: torch.Tensor) -> bool:
    """Whether ``w`` takes the fp32 packed layout: ``packable`` and the kernel built."""
    return packable(w) and load_cpu_gemm() is not None


def can_pack_16(w: torch.Tensor) -> bool:
    """Whether ``w`` takes the 16-bit packed layout: a bfloat16 / float16 ``packable`` matrix and
    the kernel built."""
    return packable(w, PACKED_16_DTYPES) and load_cpu_gemm_16() is not None


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> P [N / 16, K, 16] with P[p, k, j] = W[16 p + j, k]: the kernel's layout (in W's
    dtype: float32, or bfloat16 / float16 for ``packed_linear_16``)."""
    n, k = w.shape
    return w.reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def unpack_weight(p: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_weight`` (a new [N, K] tensor)."""
    panels, k, lanes = p.shape
    return p.transpose(1, 2).reshape(panels * lanes, k)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T + b for a ``pack_weight`` weight: [..., N]."""
    kernel = load_cpu_gemm()
    assert kernel is not None, "packed weights exist only when the kernel built"
    return kernel(x, packed, bias)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """Q [N, K] (int8; int4's 32-bit words, ``int4.pack_int4``) -> the kernel's layout: groups of 64
    rows (the last 16/32/48 when N % 64), each
    transposed to [K, rows] so one k step is one 64-byte line, concatenated and shaped
    [N / 16, K, 16] (``csrc/cpu_gemm_int8.cpp`` explains why)."""
    n, k = q.shape
    if n % PANEL:
        raise ValueError(f"int8 packing needs out_features % {PANEL} == 0, got {n}")
    full = n // INT8_GROUP_ROWS * INT8_GROUP_ROWS
    body = q[:full].reshape(n // INT8_GROUP_ROWS, INT8_GROUP_ROWS, k).transpose(1, 2).reshape(-1)
    tail = q[full:].t().reshape(-1)
    return torch.cat([body, tail]).reshape(n // PANEL, k, PANEL)


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int8`` (a new [N, K] tensor)."""
    panels, k, _ = packed.shape
    n = panels * PANEL
    full = n // INT8_GROUP_ROWS * INT8_GROUP_ROWS
    flat = packed.reshape(-1)
    body = flat[: full * k].reshape(n // INT8_GROUP_ROWS, k, INT8_GROUP_ROWS).transpose(1, 2).reshape(full, k)
    tail = flat[full * k :].reshape(k, n - full).t()
    return torch.cat([body, tail])


def pack_groups(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-group values [N, K / G] -> [N / 16, K / G, 16] in ``dtype`` (a panel's groups contiguous)."""
    n, groups = t.shape
    return t.to(dtype).reshape(n // PANEL, PANEL, groups).transpose(1, 2).contiguous()


def fits_fp16(*values: torch.Tensor | None) -> bool:
    """Whether every value of the given tensors is exactly a float16."""
    return all(torch.equal(v.float().half().float(), v.float()) for v in values if v is not None)


def pack_group_params(
    scale: torch.Tensor, zero: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's per-group scales (and zero points) packed by ``pack_groups``: in float16 when every
    value of both is exactly a float16 (``fits_fp16``: GGUF's Q4_0 / Q8_0, AWQ / GPTQ with float16
    scales, the engine's own quantizers: ``fp16_scales``), else float32. At batch 1 the kernels
    stream these beside the weights: float32 ones per 64 int4 weights are a fifth of the bytes."""
    dtype = torch.float16 if fits_fp16(scale, zero) else torch.float32
    return pack_groups(scale, dtype), None if zero is None else pack_groups(zero, dtype)


# The float16 range where a scale keeps float16's full precision (normal numbers).
_F16_MIN_NORMAL, _F16_MAX = 2.0**-14, 65504.0


def fp16_scales(scale: torch.Tensor, up: bool = False) -> torch.Tensor:
    """The scales rounded to float16 values (the nearest, or ``up`` to the next one at or above),
    so that ``pack_group_params`` can store them in half the bytes; unchanged (float32) when a
    nonzero scale lies outside float16's normal range, where rounding would cost precision."""
    scale = scale.float()
    zero = scale == 0
    if not bool((zero | ((scale.abs() >= _F16_MIN_NORMAL) & (scale.abs() <= _F16_MAX))).all()):
        return scale
    half = scale.half()
    if up:  # positive scales only (int4's (hi - lo) / 15): one float16 step up where rounding went down
        below = half.float() < scale
        half = torch.where(below, (half.view(torch.int16) + 1).view(torch.float16), half)
    return half.float()
