"""JIT-built C++ kernels for CPU (``csrc/``), one build per ISA level, with a graceful fallback
to the torch path.

One shared library holds every kernel: paged decode attention, the fused small ops (RoPE,
SiLU-and-mul, RMSNorm, the K/V write), the packed fp32 GEMM and its int8 and int4 variants, the LoRA
deltas of mixed-adapter batches, the tensor-parallel ranks' shared-memory all-reduce. Every kernel
is written once over the vector abstraction in ``csrc/cpu_vec.h``; the library is compiled per
ISA level (``cpu_info.ISA_LEVELS``: avx512, avx2, neon, portable) and registers its ops as
``torch.ops.pagedllm_<level>.*``, so several levels can be loaded in one process (the tests run
each level this CPU executes against the torch reference).

The level used is ``PAGEDLLM_CPU_ISA`` (``native``, the default, is the best this CPU runs).
Builds are cached per level, sources and flags in ``envs.kernel_build_root()`` (``TORCH_EXTENSIONS_DIR``,
else ``~/.cache/torch_extensions``): about 30 s on 2 cores the first time, which
``pagedllm build-kernels`` does at install time; a cached build loads in milliseconds. ``PAGEDLLM_CPU_KERNELS=0`` turns every
kernel off; a failed build logs why and the torch / oneDNN paths are used instead.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
import time
from dataclasses import dataclass
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
        "cpu_gemm_grouped.cpp",
        "cpu_gemm_w8a8.cpp",
        "cpu_decode_stack.cpp",
        "cpu_lora.cpp",
        "cpu_prefill_attention.cpp",
        "cpu_shm_allreduce.cpp",
        "cpu_sampling.cpp",
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


def compile_flags(level: str, dot: bool | None = None) -> list[str]:
    """The compiler flags of the ``level`` build, with its int8 dot-product extension if ``dot``
    (default: if this CPU has it; an explicit value targets another CPU, e.g. a cross build)."""
    flags = [*_COMMON_FLAGS, *_LEVEL_FLAGS[level], f"-DPAGEDLLM_OPS=pagedllm_{level}"]
    if dot is None:
        dot = cpu_info.dot_extension(level) is not None
    if dot:
        ext = _DOT_FLAGS[level]
        flags = [f for f in flags if not (ext.startswith("-march") and f.startswith("-march"))] + [ext]
    return flags


_BUILD_LOCK = threading.Lock()  # one build or load at a time in this process (a background build, a layer)
_BUILT_MARK = "build-complete"  # written next to the library once it built and loaded


@dataclass(frozen=True)
class BuildLocation:
    name: str  # pagedllm_<level>_<key>: the key is in the name, so a changed build gets a new folder
    directory: Path

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"

    def is_built(self) -> bool:
        return (self.directory / _BUILT_MARK).is_file() and self.library.is_file()


def build_location(level: str) -> BuildLocation:
    """Where the ``level`` build lives: under ``envs.kernel_build_root()``, keyed by the sources
    (headers included), the compiler flags and the torch and Python versions it is built against."""
    key = hashlib.sha256()
    for path in (*SOURCES, *sorted(_CSRC.glob("*.h"))):
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    key.update(" ".join(compile_flags(level)).encode())
    key.update(f"torch {torch.__version__} {torch.version.git_version} python {sys.version_info[:2]}".encode())
    name = f"pagedllm_{level}_{key.hexdigest()[:16]}"
    return BuildLocation(name, envs.kernel_build_root() / name)


@cache
def build_cpu_library(level: str | None = None) -> bool:
    """Load the ``level`` build (default: the selected level) and register its ops, compiling it
    first when there is no cached build; False when the kernels are disabled or the build failed."""
    if not kernels_enabled():
        return False
    level = level or selected_isa()
    with _BUILD_LOCK:
        try:
            start = time.perf_counter()
            how = _load_or_build(build_location(level), level)
        except Exception as exc:  # no compiler or ninja: the torch path still works
            logger.warning("CPU kernels (%s) unavailable, using the torch/oneDNN paths (%s)", level, exc)
            return False
    logger.info(
        "CPU kernels: %s build on %s (%s in %.1f s)",
        cpu_info.build_name(level),
        cpu_info.cpu_model(),
        how,
        time.perf_counter() - start,
    )
    return True


def _load_or_build(where: BuildLocation, level: str) -> str:
    """A finished build is loaded directly (milliseconds; cpp_extension.load would re-check it
    with ninja first, ~0.2 s); otherwise torch compiles it, with its lock against a concurrent
    build of the same folder by another process."""
    if where.is_built():
        torch.ops.load_library(str(where.library))
        return "loaded"
    from torch.utils.cpp_extension import load

    where.directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_lock(where.directory / "lock")
    load(
        name=where.name,
        sources=[str(p) for p in SOURCES],
        extra_cflags=compile_flags(level),
        extra_ldflags=["-fopenmp"],
        build_directory=str(where.directory),
        is_python_module=False,
        verbose=False,
    )
    (where.directory / _BUILT_MARK).write_text(f"{where.name}\n")
    return "built"


# A build takes seconds to a few minutes; torch's lock file older than this was left by a build
# that was killed (SIGKILL, OOM), and torch would wait on it forever.
STALE_LOCK_SECONDS = 15 * 60


def _remove_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning("removing %s, left %.0f min ago by a kernel build that did not finish", lock, age / 60)
        lock.unlink(missing_ok=True)


def needs_build(level: str | None = None) -> bool:
    """Whether using the kernels would compile them first (no finished build of ``level``)."""
    return kernels_enabled() and not build_location(level or selected_isa()).is_built()


def start_background_build(level: str | None = None) -> threading.Thread | None:
    """Compile the ``level`` build in a thread when it is missing, so the caller's own start-up
    (reading weights) overlaps it; the first kernel use then waits for the rest. None when the
    build is there already or the kernels are off."""
    level = level or (selected_isa() if kernels_enabled() else None)
    if level is None or not needs_build(level):
        return None
    logger.info(
        "CPU kernels: no %s build cached in %s; compiling it in the background (about 30 s on 2 cores; "
        "`pagedllm build-kernels` does this once at install time)",
        cpu_info.build_name(level),
        envs.kernel_build_root(),
    )
    thread = threading.Thread(target=build_cpu_library, args=(level,), name="pagedllm-kernel-build", daemon=True)
    thread.start()
    return thread


# cpu_ops' answers by what decides them: the kernel switch, the level asked for (else
# PAGEDLLM_CPU_ISA) and the build root (TORCH_EXTENSIONS_DIR). Resolving them (the switch, the ISA level, the op
# namespace) took 70-90 us of a batch-1 decode step on caches the weights had just swept
# (SmolLM2 int4, Zen 4); the sampler and the fused ops ask every step.
_OPS: dict[tuple[str, str, str], Any] = {}


def cpu_ops(level: str | None = None) -> Any | None:
    """``torch.ops.pagedllm_<level>`` (every kernel of that build), or None without the library."""
    key = (envs.get("PAGEDLLM_CPU_KERNELS"), level or envs.get("PAGEDLLM_CPU_ISA"), envs.get("TORCH_EXTENSIONS_DIR"))
    if key not in _OPS:
        _OPS[key] = _load_ops(level)
    return _OPS[key]


def _load_ops(level: str | None) -> Any | None:
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
