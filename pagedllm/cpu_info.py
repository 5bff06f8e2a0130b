"""What the CPU is and can run (torch-free): its model name, feature flags, the kernel ISA levels
it executes, and how many cores this process may use.

ISA levels, best first. Each is one build of the C++ kernel library (``layers/cpu_kernels.py``):

- ``avx512``: x86-64-v4 (AVX-512 F/BW/DQ/VL), 16-lane vectors, 32 registers;
- ``avx2``: x86-64-v3 (AVX2 + FMA), 8 lanes, 16 registers: AMD Zen 2/3, most cloud VMs;
- ``neon``: aarch64 (Graviton, Ampere, Apple M), 4 lanes, 32 registers;
- ``portable``: no explicit vector code (the compiler's own vectorisation); any CPU.

A level also uses the int8 dot-product extension the CPU has (AVX-512 VNNI, AVX-VNNI, Arm
dotprod) for the W8A8 kernel, and the avx512 build Intel AMX's int8 tiles where the CPU and the
OS allow them (chosen at run time, not a separate build); both are part of the build's name
(``avx512+vnni``, ``avx512+vnni+amx``).
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

from pagedllm import envs

ISA_LEVELS = ("avx512", "avx2", "neon", "portable")

# /proc/cpuinfo flags each x86 level needs (x86-64-v4 and -v3 as GCC defines them).
_X86_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
_LEVEL_FLAGS = {"avx512": _X86_V4, "avx2": _X86_V3}
# The int8 dot-product extension a level's build adds when the CPU has it: (cpuinfo flag, name).
_DOT_EXTENSION = {"avx512": ("avx512_vnni", "vnni"), "avx2": ("avx_vnni", "vnni"), "neon": ("asimddp", "dotprod")}


# /proc/cpuinfo flags of 16-bit float dot products or arithmetic, by dtype (x86 AVX512-BF16 /
# AMX-BF16 and AVX512-FP16 / AMX-FP16; Arm BF16 and FP16): where oneDNN's own bfloat16 / float16
# GEMMs run natively. Without them torch computes 16-bit matmuls through conversions.
_NATIVE_16_BIT_FLAGS = {
    "bfloat16": frozenset({"avx512_bf16", "amx_bf16", "bf16"}),
    "float16": frozenset({"avx512_fp16", "amx_fp16", "asimdhp"}),
}


def _cpuinfo_field(*names: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in names:
                return value.strip()
    except OSError:
        pass
    return ""


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``Intel(R) Xeon(R) ...``), as a bug report wants it."""
    return _cpuinfo_field("model name", "Model", "CPU part") or platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """Feature flags (x86 ``flags``, Arm ``Features``); empty where /proc/cpuinfo is missing."""
    return frozenset(_cpuinfo_field("flags", "Features").split())


def native_16_bit(dtype: object) -> bool:
    """Whether this CPU computes ``dtype`` natively (see _NATIVE_16_BIT_FLAGS): "bfloat16" /
    "float16" or the torch dtypes (named without importing torch here)."""
    return bool(cpu_features() & _NATIVE_16_BIT_FLAGS[str(dtype).removeprefix("torch.")])


def machine() -> str:
    return platform.machine().lower()


def runnable_isas() -> tuple[str, ...]:
    """The levels this CPU executes, best first (``portable`` always)."""
    arch, flags = machine(), cpu_features()
    if arch in ("x86_64", "amd64"):
        found = tuple(level for level, need in _LEVEL_FLAGS.items() if need <= flags)
    elif arch in ("aarch64", "arm64"):
        found = ("neon",)
    else:
        found = ()
    return (*found, "portable")


def best_isa() -> str:
    return runnable_isas()[0]


def resolve_isa(requested: str) -> str:
    """``native`` -> the best level; a named level if this CPU runs it, else ValueError."""
    if requested == "native":
        return best_isa()
    if requested not in ISA_LEVELS:
        raise ValueError(f"PAGEDLLM_CPU_ISA must be native or one of {', '.join(ISA_LEVELS)}; got {requested!r}")
    if requested not in runnable_isas():
        raise ValueError(
            f"PAGEDLLM_CPU_ISA={requested} cannot run on this CPU ({cpu_model()}); it runs {', '.join(runnable_isas())}"
        )
    return requested


def dot_extension(level: str) -> str | None:
    """The int8 dot-product extension the ``level`` build uses on this CPU (``vnni``, ``dotprod``)."""
    flag, name = _DOT_EXTENSION.get(level, ("", ""))
    return name if flag and flag in cpu_features() else None


def amx_int8(level: str) -> bool:
    """Whether the ``level`` build's W8A8 kernel runs its AMX path here: the avx512 build with VNNI
    on a CPU with AMX-TILE and AMX-INT8 (Intel Sapphire Rapids and later) whose kernel lets this
    process use the tile registers (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, Linux 5.16+; asked here
    as the kernel library asks, once per process); ``PAGEDLLM_AMX=0`` turns it off."""
    features = cpu_features()
    if (
        not envs.enabled("PAGEDLLM_AMX")
        or level != "avx512"
        or dot_extension(level) is None
        or not {"amx_tile", "amx_int8"} <= features
    ):
        return False
    return _amx_permission()


@lru_cache(maxsize=1)
def _amx_permission() -> bool:
    if platform.system() != "Linux" or machine() != "x86_64":
        return False
    import ctypes

    arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.syscall(arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0)


def build_name(level: str) -> str:
    """The kernel build's name: the level, its dot-product extension and AMX where its W8A8 kernel
    uses them (``avx512+vnni``, ``avx512+vnni+amx``)."""
    ext = dot_extension(level)
    name = f"{level}+{ext}" if ext else level
    return f"{name}+amx" if amx_int8(level) else name


def usable_cpus() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (a container
    limited to 2 CPUs on a 64-core host gets 2)."""
    return core_budget()[0]


def core_budget() -> tuple[int, str]:
    """``usable_cpus()`` and why: ``"CPU affinity: 8 of 16 cores"``, ``"cgroup CPU quota: 2 (affinity 8)"``."""
    online = os.cpu_count() or 1
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = online
    quota = _cgroup_cpu_quota()
    if quota and quota < affinity:
        return max(1, quota), f"cgroup CPU quota: {quota} (affinity {affinity} of {online} cores)"
    return max(1, affinity), f"CPU affinity: {affinity} of {online} cores" + (
        f", cgroup quota {quota}" if quota else ""
    )


def _cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Whole CPUs allowed by the cgroup (v2 ``cpu.max``, v1 ``cfs_quota_us``; a fraction rounds
    down, to at least 1), None if unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, int(quota) // int(period))
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return max(1, quota_us // period_us) if quota_us > 0 and period_us > 0 else None
