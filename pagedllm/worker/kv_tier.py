"""KVTier: the storage of the swap tier and the copies the scheduler plans into and out of it.

One store per KV cache tensor (every layer of every model: a draft model's caches too), shaped
like the cache with tier slots in place of blocks: ``[2, num_slots, block_size, KVH, D]``.

Where the store lives: on CUDA, pinned host memory (fast DMA both ways). On CPU the KV pool is
already host RAM, so a RAM tier would only be a second, copy-costing part of the same memory;
``--kv-cache-memory`` buys more prefix cache for the same bytes, with no copies. What a CPU tier
can add is a bigger, cheaper medium: so it is a memory-mapped file in the temp dir (unlinked at
once, so nothing outlives the process; its disk space allocated up front). The page cache
keeps recently used slots in RAM while memory is spare and writes them back under pressure.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import tempfile

import torch

BlockSlotPairs = list[tuple[int, int]]


class KVTier:
    """The swap tier's stores next to ``caches``; ``copy`` runs one step's planned copies."""

    def __init__(self, caches: list[torch.Tensor], num_slots: int) -> None:
        self.caches = caches
        self.num_slots = num_slots
        self.stores = _allocate_stores(caches, num_slots) if num_slots > 0 else []

    def copy(
        self, swap_out: BlockSlotPairs, swap_in: BlockSlotPairs, block_copies: BlockSlotPairs | None = None
    ) -> None:
        """Every swap-out, then the copy-on-write block copies (source, destination), then every
        swap-in: a block evicted and reused in this step is saved before anything writes it, a
        copy's source is read before a swap-in or another copy could overwrite it, and a slot
        written this step is read after it is written."""
        if swap_out:
            self._swap_out(swap_out)
        if block_copies:
            self._copy_blocks(block_copies)
        if swap_in:
            self._swap_in(swap_in)

    def _copy_blocks(self, pairs: BlockSlotPairs) -> None:
        """All sources gathered first, then scattered: one copy's destination may be another's source."""
        sources, destinations = (torch.tensor(ids, dtype=torch.int64) for ids in zip(*pairs, strict=True))
        for cache in self.caches:
            device = cache.device
            cache.index_copy_(1, destinations.to(device), cache.index_select(1, sources.to(device)))

    # index_select / index_copy_, not ``store[:, slots] = cache[:, blocks]``: advanced indexing
    # on dim 1 is some 50x slower on the CPU (0.47 s against 8 ms for 95 SmolLM-135M blocks).
    def _swap_out(self, pairs: BlockSlotPairs) -> None:
        blocks, slots = self._indices(pairs)
        for cache, store in zip(self.caches, self.stores, strict=True):
            store.index_copy_(1, slots, cache.index_select(1, blocks.to(cache.device)).to(store.device))

    def _swap_in(self, pairs: BlockSlotPairs) -> None:
        blocks, slots = self._indices(pairs)
        for cache, store in zip(self.caches, self.stores, strict=True):
            # The gather makes a pageable temporary: a plain (synchronous) copy, never one that
            # could still read the temporary after it is freed.
            cache.index_copy_(1, blocks.to(cache.device), store.index_select(1, slots).to(cache.device))

    def _indices(self, pairs: BlockSlotPairs) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, slots = zip(*pairs, strict=True)
        assert max(slots) < self.num_slots, (max(slots), self.num_slots)
        return torch.tensor(blocks, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)


def _store_shape(cache: torch.Tensor, num_slots: int) -> tuple[int, ...]:
    return (cache.shape[0], num_slots, *cache.shape[2:])


def _allocate_stores(caches: list[torch.Tensor], num_slots: int) -> list[torch.Tensor]:
    shapes = [_store_shape(c, num_slots) for c in caches]
    if all(c.device.type == "cuda" for c in caches):
        return [torch.empty(s, dtype=c.dtype, pin_memory=True) for c, s in zip(caches, shapes, strict=True)]
    sizes = [math.prod(s) * c.dtype.itemsize for c, s in zip(caches, shapes, strict=True)]
    buffer = torch.frombuffer(_mapped_temp_file(sum(sizes)), dtype=torch.uint8)
    stores, offset = [], 0
    for cache, shape, size in zip(caches, shapes, sizes, strict=True):
        stores.append(buffer[offset : offset + size].view(cache.dtype).view(shape))
        offset += size
    return stores


def _mapped_temp_file(nbytes: int) -> mmap.mmap:
    """A shared writable mapping of a new file in the temp dir, unlinked before it is used."""
    fd, path = tempfile.mkstemp(prefix="pagedllm-kv-swap-")
    try:
        os.unlink(path)  # the mapping keeps the file alive; the OS drops it when the process ends
        _reserve(fd, nbytes, os.path.dirname(path))
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _reserve(fd: int, nbytes: int, where: str) -> None:
    """Allocate the file's disk space now (milliseconds, nothing written): a store into a sparse
    mapping on a full disk would kill the process with SIGBUS. Sparse where it is unsupported."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ValueError(
                f"no room for the {nbytes / (1 << 30):.3g} GiB swap tier in {where}; lower --swap-space "
                "or set TMPDIR to a directory on a bigger disk"
            ) from e
        os.ftruncate(fd, nbytes)
