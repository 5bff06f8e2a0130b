"""BlockPool: owns every KV block, the free queue and the prefix-cache index (torch-free).

Every non-null block is in exactly one state:

* in use: ``ref_cnt > 0``, not in the free queue;
* free, cached: ``ref_cnt == 0``, in the free queue, indexed by its hash (reusable on a hit);
* free, uncached: ``ref_cnt == 0``, in the free queue, no hash.

A freed cached block keeps its hash until it is popped for reuse, which is what makes the free
queue double as the prefix cache's LRU eviction order. At that eviction the swap tier (if any,
swap_tier.py) may keep a copy of the block; ``take_kv_copies`` hands the step's copies over.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from pagedllm.kv_cache.hashing import BlockHash
from pagedllm.kv_cache.swap_tier import SwapTier


class BlockPool:
    """A fixed set of ``num_blocks`` blocks; block 0 is the reserved null block."""

    def __init__(self, num_blocks: int, enable_caching: bool, swap_tier: SwapTier | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.swap_tier = swap_tier if swap_tier is not None else SwapTier(0)
        # Blocks handed out since the last take_kv_copies(): their content is not settled until
        # the step runs, so evicting one again in the same step must not copy it to the tier.
        self._reused_this_step: set[int] = set()
        self.num_partial_blocks = 0  # indexed partial blocks: none means a lookup need not hash any

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding ``block_hash`` in the prefix cache, or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue, evicting cached ones."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} blocks: only {self.free_block_queue.num_free_blocks} are free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            self._evict_cached_block(block)
            self._reused_this_step.add(block.block_id)
            block.ref_cnt = 1
        return blocks

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        # The block's KV is about to be overwritten: it must stop answering prefix lookups.
        if block.block_hash is None:
            return
        assert self.cached_block_hash_to_block.get(block.block_hash) is block, block
        if block.block_id not in self._reused_this_step and not block.is_partial:
            self.swap_tier.offer(block.block_hash, block.block_id)
        self._uncache(block)

    def take_kv_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The planned step's tier copies, (swap-outs, swap-ins) of (block id, slot); ends the step."""
        self._reused_this_step.clear()
        return self.swap_tier.take_copies()

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], num_cached_blocks: int, num_full_blocks: int
    ) -> None:
        """Index ``blocks[num_cached_blocks:num_full_blocks]`` under ``block_hashes[i]``.

        If another block already holds a hash, that entry stays and the new block is left
        uncached: duplicate content is allowed, only one copy is indexed.
        """
        if not self.enable_caching:
            return
        assert num_full_blocks <= min(len(blocks), len(block_hashes))
        for i in range(num_cached_blocks, num_full_blocks):
            self._cache_block(blocks[i], block_hashes[i])

    def _cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        if block.is_null:
            return
        if block.block_hash is not None:
            # Already indexed, e.g. a prefix-hit block; it can only hold the same content.
            assert block.block_hash == block_hash, block
            return
        if block_hash not in self.cached_block_hash_to_block:
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def cache_partial_block(self, block: KVCacheBlock, partial_hash: BlockHash) -> None:
        """Index a request's last, partly computed block as it is freed (``partial_hash`` covers
        its computed tokens, so it never equals a full block's hash): a later request continuing
        those tokens copies it instead of recomputing them (``KVCacheManager``)."""
        if not self.enable_caching or block.is_null or block.block_hash is not None or block.ref_cnt != 1:
            return  # shared or already indexed: leave it alone
        if partial_hash not in self.cached_block_hash_to_block:
            block.block_hash, block.is_partial = partial_hash, True
            self.num_partial_blocks += 1
            self.cached_block_hash_to_block[partial_hash] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], uncache: bool = False) -> None:
        """Drop one reference per block; blocks reaching 0 join the free-queue tail in order
        (``uncache``: leaving the prefix cache too, for KV that must not be reused)."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                if uncache:
                    self._uncache(block)
                self.free_block_queue.append(block)

    def _uncache(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        if block.is_partial:
            block.is_partial = False
            self.num_partial_blocks -= 1

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free uncached + free cached)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by requests."""
        usable = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable

    def reset_prefix_cache(self) -> bool:
        """Drop every prefix-cache entry; refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.is_partial = False
        self.num_partial_blocks = 0
        self.swap_tier.reset()
        for block in self.blocks:
            block.block_hash = None
        return True

    def check_integrity(self) -> None:
        """Verify the block-state invariants above; raise RuntimeError naming what is wrong."""
        errors = self._free_queue_errors() + self._ref_cnt_errors() + self._hash_index_errors()
        errors += self.swap_tier.integrity_errors()
        if errors:
            raise RuntimeError("KV block pool integrity check failed:\n  " + "\n  ".join(errors))

    def _free_queue_errors(self) -> list[str]:
        errors = []
        free = self.free_block_queue.get_all_free_blocks()
        if len(free) != self.free_block_queue.num_free_blocks:
            errors.append(f"free queue holds {len(free)} blocks but counts {self.free_block_queue.num_free_blocks}")
        if len({id(b) for b in free}) != len(free):
            errors.append("free queue contains a block twice")
        errors += [
            f"block {b.block_id} is in the free queue with ref_cnt={b.ref_cnt}"
            for b in free
            if b.ref_cnt != 0 or b.is_null
        ]
        return errors

    def _ref_cnt_errors(self) -> list[str]:
        errors = []
        in_use = 0
        for block in self.blocks[1:]:
            in_queue = block.prev_free_block is not None
            if block.ref_cnt < 0:
                errors.append(f"block {block.block_id} has ref_cnt={block.ref_cnt}")
            elif (block.ref_cnt == 0) != in_queue:
                errors.append(f"block {block.block_id} has ref_cnt={block.ref_cnt} but in_free_queue={in_queue}")
            in_use += block.ref_cnt > 0
        free = self.free_block_queue.num_free_blocks
        if free + in_use != self.num_blocks - 1:
            errors.append(f"free ({free}) + in use ({in_use}) != usable ({self.num_blocks - 1})")
        return errors

    def _hash_index_errors(self) -> list[str]:
        errors = [
            f"cache entry {h.hex()[:12]} points to block {b.block_id} holding "
            f"{b.block_hash.hex()[:12] if b.block_hash else None}"
            for h, b in self.cached_block_hash_to_block.items()
            if b.block_hash != h
        ]
        errors += [
            f"block {b.block_id} has a hash but is not indexed by it"
            for b in self.blocks
            if b.block_hash is not None and self.cached_block_hash_to_block.get(b.block_hash) is not b
        ]
        if self.null_block.block_hash is not None or self.null_block.prev_free_block is not None:
            errors.append("the null block is cached or in the free queue")
        partial = sum(1 for b in self.blocks if b.is_partial)
        if partial != self.num_partial_blocks or any(b.is_partial and b.block_hash is None for b in self.blocks):
            errors.append(f"{partial} blocks are indexed partial blocks but the pool counts {self.num_partial_blocks}")
        return errors
