"""Every environment variable pagedllm reads, in one place (torch-free).

Values are read when asked for, not at import, so a test's ``monkeypatch.setenv`` or a
variable set before a subprocess starts takes effect. ``docs/architecture.md`` lists the
same table for users; ``tests/test_envs.py`` checks that nothing else in the package reads
``os.environ``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    meaning: str


ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("PAGEDLLM_DEVICE", "", "device used when --device is auto: cpu or cuda (default: cuda if present)"),
        EnvVar(
            "PAGEDLLM_CACHE",
            "",
            "where the demo model is built and converted GGUF tokenizers are kept (default ~/.cache/pagedllm)",
        ),
        EnvVar("PAGEDLLM_CPU_KERNELS", "1", "0 turns every C++ CPU kernel off (the torch / oneDNN paths run)"),
        EnvVar(
            "PAGEDLLM_CPU_ISA",
            "native",
            "CPU kernel build: native (the best this CPU runs), avx512, avx2, neon or portable",
        ),
        EnvVar(
            "PAGEDLLM_CPU_GEMM", "1", "0 turns only the packed GEMMs off, fp32 and 16-bit (oneDNN / torch then run)"
        ),
        EnvVar("PAGEDLLM_ONEDNN", "1", "0 keeps fp32 weights out of oneDNN's prepacked layout"),
        EnvVar(
            "PAGEDLLM_CPU_DECODE_STACK",
            "1",
            "0 runs CPU decode steps layer by layer in Python instead of one C++ call for the decoder stack",
        ),
        EnvVar(
            "PAGEDLLM_AMX",
            "1",
            "0 keeps the W8A8 kernel off Intel AMX's int8 tiles (default: used from 16 rows where the CPU has "
            "AMX-INT8 and the OS lets the process use it; read once per process)",
        ),
        EnvVar(
            "PAGEDLLM_KV_PREFAULT_MIB",
            "128",
            "how much of the CPU KV cache (MiB, all layers) a background thread keeps faulted in ahead of the "
            "highest block steps have been given, so steps do not page-fault on fresh blocks; 0 turns it off",
        ),
        EnvVar(
            "PAGEDLLM_HUGE_PAGES",
            "1",
            "0 keeps CPU weights and the KV cache out of transparent huge pages (default: their mappings ask "
            "for 2 MiB pages with MADV_HUGEPAGE)",
        ),
        EnvVar(
            "PAGEDLLM_KEEP_FREED_MEMORY",
            "1",
            "0 leaves glibc's allocator thresholds alone (default: once loaded, a CPU worker keeps freed blocks "
            "up to 32 MiB mapped for reuse, so a step's large tensors do not page-fault every step)",
        ),
        EnvVar(
            "MALLOC_MMAP_THRESHOLD_",
            "",
            "glibc's own tunable; when set (or MALLOC_TRIM_THRESHOLD_, or GLIBC_TUNABLES naming glibc.malloc), "
            "pagedllm does not change the thresholds",
        ),
        EnvVar("MALLOC_TRIM_THRESHOLD_", "", "glibc's own tunable; see MALLOC_MMAP_THRESHOLD_"),
        EnvVar("GLIBC_TUNABLES", "", "glibc's tunables; one naming glibc.malloc also leaves the thresholds alone"),
        EnvVar(
            "PAGEDLLM_EXECUTOR_TIMEOUT_S",
            "300",
            "tensor / pipeline parallelism: seconds a step may wait for a worker rank before it counts as hung",
        ),
        EnvVar(
            "PAGEDLLM_SHM_ALLREDUCE",
            "1",
            "tensor parallelism on x86 CPU: 0 all-reduces through gloo instead of shared memory",
        ),
        EnvVar(
            "PAGEDLLM_PP_LAYER_PARTITION",
            "",
            "pipeline parallelism: decoder layers per stage, e.g. 2,1 (default: an even split)",
        ),
        EnvVar(
            "PAGEDLLM_PP_BATCHES_IN_FLIGHT",
            "",
            "pipeline parallelism: batches the engine keeps running at once, 1 to the stage count "
            "(default: one per stage; 1 makes the stages take turns)",
        ),
        EnvVar(
            "PAGEDLLM_DEBUG_ENDPOINTS",
            "0",
            "1 serves GET /debug/integrity (the KV block pool's integrity check, for tests); never in production",
        ),
        EnvVar(
            "PAGEDLLM_RAY_PLACEMENT",
            "pack",
            "Ray backend: pack (ranks on as few nodes as fit, PACK) or spread (one rank per node, STRICT_SPREAD)",
        ),
        EnvVar("PAGEDLLM_RAY_CPUS_PER_RANK", "1", "Ray backend: CPUs each rank's bundle reserves (its thread count)"),
        EnvVar(
            "PAGEDLLM_HOST_IP",
            "",
            "multi-node without Ray: the address this node's ranks use and advertise (default: node 0 the "
            "--distributed-init-method host, another node its source address on the route to node 0)",
        ),
        EnvVar(
            "GLOO_SOCKET_IFNAME",
            "",
            "network interface gloo uses (default: a rank of a multi-node or Ray run picks the one holding its node's IP)",
        ),
        EnvVar("TRITON_INTERPRET", "0", "1 runs Triton kernels in Triton's CPU interpreter (tests)"),
        EnvVar(
            "TORCH_EXTENSIONS_DIR",
            "",
            "where the CPU kernel builds are cached (default ~/.cache/torch_extensions, as for torch's own)",
        ),
        EnvVar(
            "OMP_NUM_THREADS",
            "",
            "the engine's intra-op thread count (default: the cores this process may use: CPU affinity, cgroup quota)",
        ),
    )
}

_DEVICES = ("cpu", "cuda")


def get(name: str) -> str:
    """The variable's value, or its default when unset."""
    return os.environ.get(name, ENV_VARS[name].default)


def enabled(name: str) -> bool:
    """A switch that is on unless set to 0 (``PAGEDLLM_CPU_KERNELS``, ...)."""
    return get(name) != "0"


def debug_endpoints() -> bool:
    """``PAGEDLLM_DEBUG_ENDPOINTS=1``: the server adds its test-only /debug routes."""
    return get("PAGEDLLM_DEBUG_ENDPOINTS") == "1"


def device_override() -> str | None:
    """``PAGEDLLM_DEVICE`` if set; a value other than cpu or cuda is a ValueError."""
    value = get("PAGEDLLM_DEVICE")
    if not value:
        return None
    if value not in _DEVICES:
        raise ValueError(f"PAGEDLLM_DEVICE must be cpu or cuda, got {value!r}; unset it or fix its value")
    return value


def cache_dir() -> Path:
    """``$PAGEDLLM_CACHE``, else ``~/.cache/pagedllm``."""
    return Path(get("PAGEDLLM_CACHE") or Path.home() / ".cache" / "pagedllm")


def omp_num_threads() -> str:
    """``OMP_NUM_THREADS`` as set ("" when unset): torch sizes its thread pool from it itself."""
    return get("OMP_NUM_THREADS")


def set_omp_num_threads(count: int) -> None:
    """Set ``OMP_NUM_THREADS`` for this process (a tensor-parallel worker, before torch sizes its pool)."""
    os.environ["OMP_NUM_THREADS"] = str(count)


def executor_timeout_s() -> float:
    """``PAGEDLLM_EXECUTOR_TIMEOUT_S``: how long a step waits for a silent worker rank."""
    return float(get("PAGEDLLM_EXECUTOR_TIMEOUT_S"))


def pp_batches_in_flight(num_stages: int) -> int:
    """``PAGEDLLM_PP_BATCHES_IN_FLIGHT``, else ``num_stages``: how many batches a pipeline keeps running."""
    value = get("PAGEDLLM_PP_BATCHES_IN_FLIGHT")
    if not value:
        return num_stages
    if not value.isdigit() or not 1 <= int(value) <= num_stages:
        raise ValueError(
            f"PAGEDLLM_PP_BATCHES_IN_FLIGHT must be an integer from 1 to the pipeline's {num_stages} stages, "
            f"got {value!r}; unset it for one batch per stage"
        )
    return int(value)


def ray_placement() -> str:
    """``PAGEDLLM_RAY_PLACEMENT`` as a Ray placement strategy: PACK or STRICT_SPREAD."""
    value = get("PAGEDLLM_RAY_PLACEMENT")
    strategies = {"pack": "PACK", "spread": "STRICT_SPREAD"}
    if value not in strategies:
        raise ValueError(f"PAGEDLLM_RAY_PLACEMENT must be pack or spread, got {value!r}")
    return strategies[value]


def ray_cpus_per_rank() -> int:
    value = get("PAGEDLLM_RAY_CPUS_PER_RANK")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"PAGEDLLM_RAY_CPUS_PER_RANK must be a positive integer, got {value!r}")
    return int(value)


def host_ip() -> str | None:
    """``PAGEDLLM_HOST_IP`` if set: this node's address in a multi-node run."""
    return get("PAGEDLLM_HOST_IP") or None


def set_gloo_socket_ifname(name: str) -> None:
    """Make gloo bind (and advertise) ``name``'s address rather than what the hostname resolves to."""
    os.environ["GLOO_SOCKET_IFNAME"] = name


def kernel_build_root() -> Path:
    """``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``: where the CPU kernel builds live."""
    return Path(get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")


def pagedllm_vars_set() -> dict[str, str]:
    """Every ``PAGEDLLM_*`` variable in the environment (known or not), for bug reports."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("PAGEDLLM_")}


def triton_interpret() -> bool:
    return get("TRITON_INTERPRET") not in ("", "0")
