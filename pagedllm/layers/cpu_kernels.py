"""JIT-built C++ kernels for CPU (``csrc/``), with a graceful fallback to the torch path.

One shared library holds every kernel: paged decode attention, the fused small ops (RoPE,
SiLU-and-mul, the K/V write) as ``torch.ops.pagedllm_cpu.*``, the packed GEMM as
``torch.ops.pagedllm_cpu_gemm.*`` and its weight-only int8 variant as ``torch.ops.pagedllm_cpu_int8.*``.
It is built once per machine on first use (a few seconds; cached by torch in
``~/.cache/torch_extensions``). ``PAGEDLLM_CPU_KERNELS=0`` turns every kernel
off; a failed build logs why and the torch / oneDNN paths are used instead.
"""

from __future__ import annotations

import hashlib
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from pagedllm import envs

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parents[1] / "csrc"
_SOURCES = [
    _CSRC / name
    for name in ("cpu_ops.cpp", "cpu_paged_attention.cpp", "cpu_fused_ops.cpp", "cpu_gemm.cpp", "cpu_gemm_int8.cpp")
]
# -fopenmp: at::parallel_for is a header template that only goes parallel when compiled with
# OpenMP; the library then shares torch's already-loaded libgomp (same soname), one thread pool.
_FLAGS = ["-O3", "-march=native", "-fopenmp"]


def kernels_enabled(switch: str | None = None) -> bool:
    """``PAGEDLLM_CPU_KERNELS=0`` turns off every kernel; ``switch`` (an env var name) one more."""
    return all(envs.enabled(var) for var in ("PAGEDLLM_CPU_KERNELS", switch) if var)


@lru_cache(maxsize=1)
def build_cpu_library() -> bool:
    """Compile and load the library (registering its ops); False when disabled or it failed."""
    if not kernels_enabled():
        return False
    try:
        from torch.utils.cpp_extension import load

        load(
            name=f"pagedllm_cpu_{_cpu_tag()}",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        return True
    except Exception as exc:  # no compiler or ninja: the torch path still works
        logger.warning("CPU kernels unavailable, using the torch/oneDNN paths (%s)", exc)
        return False


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags: the build uses -march=native, and a cache directory
    shared between different CPUs (a network home) must not hand one CPU the other's binary."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        import platform

        flags = platform.machine() + platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


def load_cpu_kernels() -> Any | None:
    """``torch.ops.pagedllm_cpu`` (attention and fused ops), or None without the library."""
    return torch.ops.pagedllm_cpu if build_cpu_library() else None


def cpu_fp32_kernels(x: torch.Tensor) -> Any | None:
    """The kernels when ``x`` is a float32 CPU tensor they apply to, else None (use torch)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return load_cpu_kernels()
