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

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parents[3] / "csrc" / "cpu_paged_attention.cpp"


@lru_cache(maxsize=1)
def load_cpu_kernels() -> ModuleType | None:
    """The compiled module, or None when disabled or the build failed."""
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="pagedllm_cpu_kernels", sources=[str(_SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-ffast-math"], verbose=False)
    except Exception as exc:  # no compiler or ninja: the torch path still works
        logger.warning("CPU attention kernels unavailable, using the torch path (%s)", exc)
        return None
