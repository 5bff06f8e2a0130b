"""Host memory of a CPU worker: freed blocks kept mapped for reuse (glibc's allocator), so a step's
large tensors do not page-fault afresh every step; and the weights and the KV cache in transparent
huge pages (``anonymous_pages``, ``weights_to_huge_pages``, below); and the KV cache's pages touched
ahead of the blocks steps are given (``KVPrefaulter``, below).

A decode step allocates and frees tensors of megabytes: the logits (batch x vocabulary x 4 bytes,
12.6 MB at 64 rows of a 49k vocabulary), the sampler's float32 copy, probabilities and running
sums, prefill activations. glibc serves a block above its mmap threshold with a fresh mapping
and unmaps it on free (the threshold only rises to the largest size freed so far), and it gives
the top of its heap back to the kernel once more than the trim threshold is free there. Either
way the next step touches new pages, and every 4 KiB page is a fault: measured on a 2-vCPU KVM
guest, a 25 MB float64 ``cumsum`` of a batch of 64 took 11-22 ms inside an engine step against
~3 ms with its memory reused.

Once the model and the KV cache are in place (their allocations are done, so their layout is
unchanged), the worker raises both thresholds: blocks up to glibc's ceiling of 32 MiB come from
the heap, and a free heap top is kept up to 1 GiB. The process then holds its steps' high-water
mark of host memory, as a CUDA caching allocator holds device memory. The setting is the whole
process's and stays for its life: with the offline ``LLM`` API that is the user's own process.
glibc's own tunables in the environment (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``GLIBC_TUNABLES`` naming ``glibc.malloc``) are left as the user set them;
``PAGEDLLM_KEEP_FREED_MEMORY=0`` turns this off.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import platform
import sys
import threading
import weakref

import torch

from pagedllm import envs

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2): larger blocks are always mapped.
MMAP_THRESHOLD_MAX = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (see the module docstring); False
    where it does not apply (not glibc, turned off, or the user set glibc's tunables)."""
    if not envs.enabled("PAGEDLLM_KEEP_FREED_MEMORY"):
        return False
    if not _glibc():
        return False
    if (
        envs.get("MALLOC_MMAP_THRESHOLD_")
        or envs.get("MALLOC_TRIM_THRESHOLD_")
        or "glibc.malloc" in envs.get("GLIBC_TUNABLES")
    ):
        return False
    libc = ctypes.CDLL(None)
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if ok:
        logger.debug("host allocator: blocks up to 32 MiB from the heap, up to 1 GiB of free heap kept")
    else:
        logger.warning("mallopt refused the allocator thresholds; freed host memory goes back to the kernel")
    return ok


# ---- huge pages for the weights and the KV cache ----
# A decode step streams every weight once and, at long contexts, more KV cache than weights. With
# 4 KiB pages each page is a TLB entry to walk and the hardware prefetcher stops at its end; with
# 2 MiB pages (transparent huge pages, which Linux gives an anonymous mapping that asks for them
# with MADV_HUGEPAGE before its first touch, in the kernel's default "madvise" mode) a 64 MB
# stream is 32 pages. On Zen 4 (2 threads) SmolLM2-shaped float32 decode steps at 1000-token
# contexts took 1.05-1.08x less time with them; its linears alone 1.01-1.09x (benchmarks.huge_pages,
# docs/benchmarks.md). Weights are many tensors of under 2 MiB, so they are copied into one mapping
# (weights_to_huge_pages); the KV cache is its own mapping.
HUGE_PAGE = 2 << 20
_ALIGN = 64  # each storage's start in the arena: a cache line, and every dtype's size divides it


def anonymous_pages(nbytes: int, huge: bool | None = None) -> torch.Tensor:
    """``nbytes`` of fresh anonymous memory as a uint8 tensor, zero-filled by the OS on first touch
    (no pass writing zeros) and, if ``huge`` (default: unless PAGEDLLM_HUGE_PAGES=0), in huge pages
    where the kernel gives them. The tensor keeps the mapping alive."""
    if huge is None:
        huge = envs.enabled("PAGEDLLM_HUGE_PAGES")
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KiB pages as before
            pages.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes]


def weights_to_huge_pages(model: torch.nn.Module) -> int:
    """Move every CPU parameter and buffer of ``model`` into one mapping in huge pages
    (anonymous_pages), in model order, and return the bytes moved (0: nothing moved, e.g. under
    2 MiB in all, PAGEDLLM_HUGE_PAGES=0, or not Linux). Each tensor keeps its identity, dtype,
    shape and strides (``set_`` onto the new storage), so tensors sharing a storage (tied
    embeddings, views) still share it. Call once the weights are final (after
    process_weights_after_loading) and before anything keeps views of them."""
    if not (
        envs.enabled("PAGEDLLM_HUGE_PAGES") and sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
    ):
        return 0
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in model.modules():
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is not None and t.device.type == "cpu" and t.layout == torch.strided and id(t) not in seen:
                seen.add(id(t))
                tensors.append(t)
    offsets: dict[int, int] = {}  # storage address -> its offset in the arena
    total = 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in offsets:
            offsets[key] = total
            total += -(-t.untyped_storage().nbytes() // _ALIGN) * _ALIGN
    if total < HUGE_PAGE:
        return 0
    arena = anonymous_pages(total)
    storage = arena.untyped_storage()
    copied: set[int] = set()
    since_trim = 0
    with torch.no_grad():
        for t in tensors:
            old = t.untyped_storage()
            key, start = old.data_ptr(), offsets[old.data_ptr()]
            if key not in copied:  # the whole storage once, bytes as they are
                copied.add(key)
                arena[start : start + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
                since_trim += old.nbytes()
            del old
            t.set_(storage, (start + t.storage_offset() * t.element_size()) // t.element_size(), t.size(), t.stride())
            if since_trim >= _TRIM_EVERY:  # the old copies freed so far back to the kernel: the peak stays
                since_trim = 0  # about the weights' size plus this much
                release_freed_memory()
    release_freed_memory()
    logger.debug("weights: %.1f MiB moved into huge pages", total / 2**20)
    return total


_TRIM_EVERY = 64 << 20


def release_freed_memory() -> None:
    """Hand the free pages of glibc's heap back to the kernel (malloc_trim); a no-op elsewhere. Freed
    tensors below glibc's mmap threshold stay in the heap, mapped, until then: after moving SmolLM2's
    float32 weights the process held 1.03-1.30 GB instead of 0.98."""
    if _glibc():
        ctypes.CDLL(None).malloc_trim(0)


def _glibc() -> bool:
    """Linux with glibc's allocator (mallopt, malloc_trim)."""
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


# ---- the KV cache's pages, touched ahead of use ----
# The KV cache is fresh anonymous memory (anonymous_pages): no start-up pass writes its GiBs, and
# each page is faulted in (and zero-filled by the kernel) when a step first writes a block there.
# The free-block queue hands blocks out in id order until the pool has been used once, so for a
# new server's first pool-full of tokens every block a step writes is such a fault, inside the
# step: measured on a 2-vCPU VM (Sapphire Rapids-class Xeon), a 512-token prefill's K/V writes
# took 2.4 ms per layer on fresh pages against 0.16 ms on touched ones, 22% of the prefill. A
# KVPrefaulter thread keeps the pages of the next PAGEDLLM_KV_PREFAULT_MIB of blocks (all layers)
# populated ahead of the highest block a step has been given (madvise MADV_POPULATE_WRITE,
# Linux 5.14+, outside the GIL, at a lower priority), so steps find their blocks' pages mapped and
# the process's memory still grows only about as fast as the pool is used.
MADV_POPULATE_WRITE = 23
PAGE = 4096


class KVPrefaulter:
    """Populates the pages of blocks ``[0, newest + ahead)`` of every cache in ``caches`` (each
    ``[2, num_blocks, ...]``, contiguous, made by ``anonymous_pages``) in a background thread,
    ``newest`` being the highest block id passed to ``saw``. Stops for good once every block is
    populated, on close, once the caches are gone (it holds them weakly: a dropped engine's cache is
    freed, and the thread notices within a second), or on the first madvise error (a kernel without
    MADV_POPULATE_WRITE)."""

    def __init__(self, caches: list[torch.Tensor], num_blocks: int, ahead_bytes: int) -> None:
        self._planes = []  # (address of block 0, bytes per block) of every K and V plane
        for cache in caches:
            plane_bytes = cache[0].numel() * cache.element_size()
            self._planes += [(cache.data_ptr() + p * plane_bytes, plane_bytes // num_blocks) for p in (0, 1)]
        self._caches = [weakref.ref(c) for c in caches]
        block_bytes = sum(b for _, b in self._planes)
        self._num_blocks = num_blocks
        self._ahead = max(1, ahead_bytes // block_bytes)
        self._chunk = max(1, (8 << 20) // block_bytes)  # blocks per madvise round: 8 MiB over all planes
        self._done = 0  # blocks [0, done) are populated
        self._target = min(num_blocks, self._ahead)
        self._closed = False
        self._cond = threading.Condition()
        self.active = True  # False once the thread has stopped: saw() is then not worth calling
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._thread = threading.Thread(target=self._run, name="kv-prefault", daemon=True)
        self._thread.start()

    @classmethod
    def for_caches(cls, caches: list[torch.Tensor], num_blocks: int) -> KVPrefaulter | None:
        """A prefaulter for a CPU worker's caches, or None: turned off (PAGEDLLM_KV_PREFAULT_MIB=0),
        not Linux, no caches or not CPU ones."""
        ahead = int(envs.get("PAGEDLLM_KV_PREFAULT_MIB")) << 20
        if ahead <= 0 or not sys.platform.startswith("linux") or not caches or num_blocks <= 0:
            return None
        if any(c.device.type != "cpu" or not c.is_contiguous() or c.shape[:2] != (2, num_blocks) for c in caches):
            return None
        return cls(caches, num_blocks, ahead)

    def saw(self, newest_block: int) -> None:
        """A step was given blocks up to ``newest_block``: keep the next ``ahead`` populated."""
        target = min(self._num_blocks, newest_block + 1 + self._ahead)
        if target > self._target:
            with self._cond:
                self._target = max(self._target, target)
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    @property
    def populated_blocks(self) -> int:
        return self._done

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # below the steps' threads
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            while True:
                with self._cond:
                    while not self._closed and self._target <= self._done and self._alive():
                        self._cond.wait(timeout=1.0)
                    if self._closed:
                        return
                    end = min(self._target, self._done + self._chunk)
                caches = [ref() for ref in self._caches]  # alive through the madvise calls
                if any(c is None for c in caches) or not self._populate(self._done, end):
                    return
                del caches
                self._done = end
                if end >= self._num_blocks:
                    return
        finally:
            self.active = False

    def _alive(self) -> bool:
        return all(ref() is not None for ref in self._caches)

    def _populate(self, first: int, end: int) -> bool:
        for base, block_bytes in self._planes:
            start = (base + first * block_bytes) // PAGE * PAGE  # the mapping starts on a page
            stop = -(-(base + end * block_bytes) // PAGE) * PAGE  # and ends on one (mmap rounds up)
            if self._madvise(start, stop - start, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                logger.debug("KV cache prefaulting stopped: madvise: %s", os.strerror(err))
                return False
        return True
