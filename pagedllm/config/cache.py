"""The paged KV cache: ``CacheArgs`` -> frozen ``CacheConfig``."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass

from pagedllm.config.choices import KV_CACHE_DTYPE_CHOICES, KV_CACHE_DTYPES, canonical_dtype
from pagedllm.config.options import GiB, check_choice, check_positive, option

# The CPU KV pool when kv_cache_memory is not given (CUDA sizes its pool from the free memory).
DEFAULT_CPU_KV_CACHE_GIB = 4.0
# The most of the host's RAM (CUDA: pinned) or of the temp dir's free disk (CPU) a swap tier may take.
MAX_SWAP_SHARE_OF_RAM = 0.7
MAX_SWAP_SHARE_OF_DISK = 0.9

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_memory_bytes: int | None  # CPU: the KV pool's size (resolved: never None on CPU)
    gpu_memory_utilization: float  # CUDA: share of device memory for weights + activations + KV
    enable_prefix_caching: bool
    num_gpu_blocks_override: int | None = None
    swap_space_bytes: int = 0  # the swap tier for evicted prefix-cache blocks (0: none)
    kv_cache_dtype: str = "float32"  # resolved: float32 | bfloat16 | float16 (resolve_kv_cache_dtype)


@dataclass
class CacheArgs:
    """How big the KV pool is and how it is cut into blocks."""

    block_size: int = option(16, "tokens per KV-cache block (a multiple of 8)")
    kv_cache_memory: float | None = option(
        None,
        "KV cache size in GiB on CPU, capped at what max_num_seqs full-length requests use",
        default_help=f"{DEFAULT_CPU_KV_CACHE_GIB:g} GiB on CPU",
    )
    gpu_memory_utilization: float = option(0.9, "share of GPU memory for weights, activations and KV cache on CUDA")
    enable_prefix_caching: bool = option(True, "reuse KV blocks of shared prompt prefixes")
    num_gpu_blocks_override: int | None = option(
        None,
        "use exactly this many KV blocks (the null block included) instead of sizing the pool from memory",
        default_help="sized from memory",
    )
    swap_space: float = option(
        0.0,
        "a second KV tier of this many GiB for evicted prefix-cache blocks: a later prefix hit copies "
        "them back instead of recomputing them. CUDA: pinned host memory; CPU: a memory-mapped file in "
        "the temp dir (TMPDIR). 0: off. Preemption still frees blocks (no swap-mode preemption)",
        metavar="GiB",
    )
    kv_cache_dtype: str = option(
        "auto",
        "dtype the KV cache holds (auto: the model's). On CPU a float32 model may keep bfloat16 or float16 "
        "K/V: half the cache memory (twice the tokens in the pool) and half the bytes decode attention "
        "reads, attention still computing in float32; output then differs slightly from float32 K/V",
        choices=KV_CACHE_DTYPE_CHOICES,
    )

    def create_cache_config(self, device: str, model_dtype: str = "float32") -> CacheConfig:
        check_positive("block_size", self.block_size)
        if self.block_size % 8:
            raise ValueError(f"block_size must be a multiple of 8 (16 is the default), got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        swap_bytes = self._swap_space_bytes(device)
        gib = self.kv_cache_memory
        if gib is None and device == "cpu":
            gib = DEFAULT_CPU_KV_CACHE_GIB
        memory = None if gib is None else int(gib * GiB)
        return CacheConfig(
            self.block_size,
            memory,
            self.gpu_memory_utilization,
            self.enable_prefix_caching,
            self.num_gpu_blocks_override,
            swap_bytes,
            resolve_kv_cache_dtype(self.kv_cache_dtype, model_dtype, device),
        )

    def _swap_space_bytes(self, device: str) -> int:
        """--swap-space in bytes, checked against what backs the tier on ``device``."""
        if self.swap_space is None or self.swap_space == 0:
            return 0
        if not self.swap_space > 0:  # negative or NaN
            raise ValueError(f"swap_space must be >= 0 GiB (0 turns the swap tier off), got {self.swap_space}")
        wanted = int(self.swap_space * GiB)
        check_swap_fits(wanted, device)
        if not self.enable_prefix_caching:
            logger.warning("swap_space=%g GiB is unused: the swap tier holds prefix-cache blocks", self.swap_space)
            return 0
        return wanted


def check_swap_fits(nbytes: int, device: str) -> None:
    """Refuse a swap tier the host cannot back: CUDA pins host RAM, CPU maps a temp-dir file."""
    if device == "cpu":
        where = tempfile.gettempdir()
        limit = int(shutil.disk_usage(where).free * MAX_SWAP_SHARE_OF_DISK)
        what, fix = f"of the free disk space in {where}", "or set TMPDIR to a directory on a bigger disk"
    else:
        limit = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * MAX_SWAP_SHARE_OF_RAM)
        what, fix = "of the host's RAM (pinned)", "or free host memory"
    if nbytes > limit:
        raise ValueError(
            f"swap_space={nbytes / GiB:.3g} GiB is more than {limit / GiB:.3g} GiB, the most this engine "
            f"takes {what}; lower --swap-space {fix}"
        )


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str, device: str) -> str:
    """--kv-cache-dtype against the model's resolved dtype: auto or the model's own, or on CPU a
    16-bit cache under a float32 model (the kernels widen it as they read); else a ValueError."""
    kv = canonical_dtype(kv_cache_dtype)
    check_choice("kv_cache_dtype", kv, KV_CACHE_DTYPES)
    if kv in ("auto", model_dtype):
        return model_dtype
    if device != "cpu":
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} differs from the model's dtype ({model_dtype}); only CPU runs "
            f"that, on {device} the KV cache holds the model's dtype: drop kv_cache_dtype (or pass 'auto')"
        )
    if model_dtype != "float32" or kv == "float32":
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} with dtype {model_dtype}: a KV cache narrower than the model "
            "is supported for float32 models only (bfloat16 or float16 K/V); drop kv_cache_dtype or pass 'auto'"
        )
    return kv
