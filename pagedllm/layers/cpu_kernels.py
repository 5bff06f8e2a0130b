"""JIT-built C++ kernels for CPU (``csrc/``), with a graceful fallback to the torch path.

The build runs once per machine (cached by torch in ``~/.cache/torch_extensions``) on first
use. ``PAGEDLLM_CPU_KERNELS=0`` turns the kernels off; a failed build logs why and the torch
reference path is used instead.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parents[1] / "csrc"
_SOURCES = [_CSRC / name for name in ("cpu_bindings.cpp", "cpu_paged_attention.cpp", "cpu_fused_ops.cpp")]


def cpu_fp32_kernels(x: torch.Tensor) -> ModuleType | None:
    """The kernels when ``x`` is a float32 CPU tensor they apply to, else None (use torch)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return load_cpu_kernels()


@lru_cache(maxsize=1)
def load_cpu_kernels() -> ModuleType | None:
    """The compiled module, or None when disabled or the build failed."""
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="pagedllm_cpu_kernels", sources=[str(p) for p in _SOURCES],
                    extra_cflags=["-O3", "-march=native", "-ffast-math"], verbose=False)
    except Exception as exc:  # no compiler or ninja: the torch path still works
        logger.warning("CPU kernels unavailable, using the torch path (%s)", exc)
        return None
