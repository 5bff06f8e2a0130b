"""JIT-built C++ kernels for CPU (``csrc/``), one build per ISA level, with a graceful fallback
to the torch path.

One shared library holds every kernel: paged decode attention, the fused small ops (RoPE,
SiLU-and-mul, RMSNorm, the K/V write), the packed fp32 GEMM and its int8 variants. Every kernel
is written once over the vector abstraction in ``csrc/cpu_vec.h``; the library is compiled per
ISA level (``cpu_info.ISA_LEVELS``: avx512, avx2, neon, portable) and registers its ops as
``torch.ops.pagedllm_<level>.*``, so several levels can be loaded in one process (the tests run
each level this CPU executes against the torch reference).

The level used is ``PAGEDLLM_CPU_ISA`` (``native``, the default, is the best this CPU runs).
Builds are cached per level and flags by torch in ``~/.cache/torch_extensions`` (about 30 s on 2
cores the first time, a fraction of a second after). ``PAGEDLLM_CPU_KERNELS=0`` turns every
kernel off; a failed build logs why and the torch / oneDNN paths are used instead.
"""

from __future__ import annotations

import hashlib
import logging
import time
from functools import cache
from pathlib import Path
from typing import Any

import torch

from pagedllm import cpu_info, envs

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCES = tuple(
    _CSRC / name
    for name in (
        "cpu_ops.cpp",
        "cpu_paged_attention.cpp",
        "cpu_fused_ops.cpp",
        "cpu_gemm.cpp",
        "cpu_gemm_int8.cpp",
        "cpu_gemm_w8a8.cpp",
    )
)
# -fopenmp: at::parallel_for is a header template that only goes parallel when compiled with
# OpenMP; the library then shares torch's already-loaded libgomp (same soname), one thread pool.
_COMMON_FLAGS = ("-O3", "-fopenmp")
_LEVEL_FLAGS = {
    "avx512": ("-march=x86-64-v4", "-mtune=native"),
    "avx2": ("-march=x86-64-v3", "-mtune=native"),
    "neon": ("-march=armv8-a",),
    "portable": ("-DPAGEDLLM_PORTABLE",),
}
_DOT_FLAGS = {"avx512": "-mavx512vnni", "avx2": "-mavxvnni", "neon": "-march=armv8.2-a+dotprod"}


def kernels_enabled(switch: str | None = None) -> bool:
    """``PAGEDLLM_CPU_KERNELS=0`` turns off every kernel; ``switch`` (an env var name) one more."""
    return all(envs.enabled(var) for var in ("PAGEDLLM_CPU_KERNELS", switch) if var)


def selected_isa() -> str:
    """The level the engine uses: ``PAGEDLLM_CPU_ISA`` resolved on this CPU (ValueError if it
    names a level this CPU cannot run)."""
    return cpu_info.resolve_isa(envs.get("PAGEDLLM_CPU_ISA"))


def compile_flags(level: str) -> list[str]:
    """The compiler flags of the ``level`` build on this CPU (its dot-product extension included)."""
    flags = [*_COMMON_FLAGS, *_LEVEL_FLAGS[level], f"-DPAGEDLLM_OPS=pagedllm_{level}"]
    if cpu_info.dot_extension(level):
        dot = _DOT_FLAGS[level]
        flags = [f for f in flags if not (dot.startswith("-march") and f.startswith("-march"))] + [dot]
    return flags


@cache
def build_cpu_library(level: str | None = None) -> bool:
    """Compile (or load from the cache) and register the ``level`` build (default: the selected
    level); False when the kernels are disabled or the build failed."""
    if not kernels_enabled():
        return False
    level = level or selected_isa()
    flags = compile_flags(level)
    try:
        from torch.utils.cpp_extension import load

        start = time.perf_counter()
        load(
            name=f"pagedllm_{level}_{hashlib.sha256(' '.join(flags).encode()).hexdigest()[:8]}",
            sources=[str(p) for p in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        logger.info(
            "CPU kernels: %s build on %s (%.1f s to build or load)",
            cpu_info.build_name(level),
            cpu_info.cpu_model(),
            time.perf_counter() - start,
        )
        return True
    except Exception as exc:  # no compiler or ninja: the torch path still works
        logger.warning("CPU kernels (%s) unavailable, using the torch/oneDNN paths (%s)", level, exc)
        return False


def cpu_ops(level: str | None = None) -> Any | None:
    """``torch.ops.pagedllm_<level>`` (every kernel of that build), or None without the library."""
    if not kernels_enabled():
        return None
    level = level or selected_isa()
    return getattr(torch.ops, f"pagedllm_{level}") if build_cpu_library(level) else None


def kernel_build() -> str:
    """What runs, for logs and ``pagedllm env``: the build's name (``avx512+vnni``) or why none."""
    if not kernels_enabled():
        return "off (PAGEDLLM_CPU_KERNELS=0)"
    level = selected_isa()
    return cpu_info.build_name(level) if build_cpu_library(level) else f"{level} (build failed: torch paths)"


def cpu_fp32_kernels(x: torch.Tensor) -> Any | None:
    """The kernels when ``x`` is a float32 CPU tensor they apply to, else None (use torch)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return cpu_ops()
