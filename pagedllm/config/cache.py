"""The paged KV cache: ``CacheArgs`` -> frozen ``CacheConfig``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedllm.config.options import GiB, check_positive, option

# The CPU KV pool when kv_cache_memory is not given (CUDA sizes its pool from the free memory).
DEFAULT_CPU_KV_CACHE_GIB = 4.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_memory_bytes: int | None  # CPU: the KV pool's size (resolved: never None on CPU)
    gpu_memory_utilization: float  # CUDA: share of device memory for weights + activations + KV
    enable_prefix_caching: bool
    num_gpu_blocks_override: int | None = None


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
    swap_space: float | None = option(
        None,
        "vLLM's host-memory KV swap space in GiB, accepted so its command lines run; it has NO effect here "
        "(no host KV tier: preempted requests and evicted prefix-cache blocks are recomputed) and logs a "
        "warning at start-up",
        default_help="none: no host KV tier",
        metavar="GiB",
    )

    def create_cache_config(self, device: str) -> CacheConfig:
        check_positive("block_size", self.block_size)
        if self.block_size % 8:
            raise ValueError(f"block_size must be a multiple of 8 (16 is the default), got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space is not None:
            if self.swap_space < 0:
                raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
            logger.warning(
                "swap_space=%g GiB (--swap-space) has no effect: pagedllm has no host-memory KV tier; preempted "
                "requests and evicted prefix-cache blocks are recomputed",
                self.swap_space,
            )
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
        )
