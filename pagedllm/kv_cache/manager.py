"""KVCacheManager: per-request block tables on top of the BlockPool (torch-free).

The scheduler's view of KV memory. It answers three questions each step: how much of a new
request's prompt is already cached (``get_computed_blocks``), can a request get the blocks its
next tokens need (``allocate_slots``, all-or-nothing), and give a finished or preempted
request's blocks back (``free``).

With a swap tier (``num_swap_slots``), a lookup continues past the device pool's hits into the
tier; those tier hits count as computed, and the ``allocate_slots`` that follows gives them fresh
blocks and plans their swap-ins. Only that call commits them: a failed allocation plans nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagedllm.kv_cache.block import KVCacheBlock
from pagedllm.kv_cache.block_pool import BlockPool
from pagedllm.kv_cache.hashing import BlockHash, partial_block_hash, update_request_block_hashes
from pagedllm.kv_cache.swap_tier import SwapTier

if TYPE_CHECKING:
    from pagedllm.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request id to its block table and keeps its full blocks in the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_swap_slots: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.swap_tier = SwapTier(num_swap_slots if enable_caching else 0)
        self.block_pool = BlockPool(num_blocks, enable_caching, self.swap_tier)
        # The last lookup's tier hits (request id, hashes); only the next allocate_slots call may
        # use them, so a lookup that is never followed by an allocation leaves nothing behind.
        self._tier_hits: tuple[str, list[BlockHash]] | None = None
        # The last lookup's partial-block hit (request id, cached partial block, its tokens), and
        # the step's block copies (source, destination): a hit is copied into the request's own
        # fresh block before the forward (copy-on-write), since the request writes into it.
        self._partial_hit: tuple[str, KVCacheBlock, int] | None = None
        self._block_copies: list[tuple[int, int]] = []
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # Prefix-cache stats in tokens, since the last make_prefix_cache_stats() call.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        """Fraction of usable KV blocks held by requests."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (cached free blocks included)."""
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request``: (blocks, num_computed_tokens).

        At least one token is always left to compute, because the model must run on the last
        token to produce logits for the next one. The blocks are not referenced yet: pass them
        to ``allocate_slots`` as ``new_computed_blocks``.
        """
        if not self.enable_caching:
            return [], 0
        update_request_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = self._find_longest_cache_hit(request.block_hashes[:max_hit_blocks])
        tier_hits = self._find_tier_hits(request.block_hashes[len(blocks) : max_hit_blocks])
        self._tier_hits = (request.request_id, tier_hits) if tier_hits else None
        num_full = len(blocks) + len(tier_hits)
        partial = self._find_partial_hit(request, num_full)
        self._partial_hit = (request.request_id, *partial) if partial is not None else None
        num_computed_tokens = num_full * self.block_size + (partial[1] if partial is not None else 0)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_computed_tokens
        return blocks, num_computed_tokens

    def _find_longest_cache_hit(self, block_hashes: list[BlockHash]) -> list[KVCacheBlock]:
        # Hashes are chained, so the first miss ends the prefix: nothing after it can match.
        blocks = []
        for block_hash in block_hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _find_tier_hits(self, block_hashes: list[BlockHash]) -> list[BlockHash]:
        hits = []
        for block_hash in block_hashes:
            if self.swap_tier.lookup(block_hash) is None:
                break
            hits.append(block_hash)
        return hits

    def _find_partial_hit(self, request: Request, block_index: int) -> tuple[KVCacheBlock, int] | None:
        """The longest cached partial block that continues the request's tokens after its
        ``block_index`` full blocks (leaving the last token to compute), as (block, tokens)."""
        if not self.block_pool.num_partial_blocks:
            return None  # no partial entry to find: skip hashing 15 candidate lengths
        limit = min(self.block_size - 1, request.num_tokens - 1 - block_index * self.block_size)
        for num_tokens in range(limit, 0, -1):
            block = self.block_pool.get_cached_block(
                partial_block_hash(request, block_index, num_tokens, self.block_size)
            )
            if block is not None:
                return block, num_tokens
        return None

    def make_prefix_cache_stats(self) -> tuple[int, int]:
        """(queried tokens, hit tokens) since the last call; resets both counters."""
        stats = (self.prefix_cache_queries, self.prefix_cache_hits)
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        return stats

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Give ``request`` the blocks for its next ``num_new_tokens`` (+ lookahead) tokens.

        ``new_computed_blocks`` are prefix-cache hits from ``get_computed_blocks`` (admission
        only; ``request.num_computed_tokens`` must not include them yet). Returns the ids of the
        blocks appended to the request's block table, in table order, or None with no state
        change when the pool cannot supply them. Tier hits of the lookup just before this call
        get the first fresh blocks after ``new_computed_blocks`` (swap-ins).
        """
        new_computed = new_computed_blocks or []
        tier_hits = self._take_tier_hits(request.request_id)
        partial = self._take_partial_hit(request.request_id)
        table = self.req_to_blocks.get(request.request_id, [])
        assert not ((new_computed or tier_hits or partial) and table), "prefix hits are only passed on admission"
        num_computed = request.num_computed_tokens + (len(new_computed) + len(tier_hits)) * self.block_size
        num_computed += partial[1] if partial is not None else 0
        num_required = _cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_to_allocate = max(0, num_required - len(table) - len(new_computed))
        if not self._can_allocate(num_to_allocate, new_computed):
            return None
        new_blocks = self._append_blocks(request.request_id, new_computed, num_to_allocate, tier_hits)
        if partial is not None:  # its tokens go into the first block after the full hits
            destination = new_blocks[len(new_computed) + len(tier_hits)]
            self._block_copies.append((partial[0].block_id, destination.block_id))
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return [block.block_id for block in new_blocks]

    def _take_tier_hits(self, request_id: str) -> list[BlockHash]:
        last, self._tier_hits = self._tier_hits, None
        return last[1] if last is not None and last[0] == request_id else []

    def _take_partial_hit(self, request_id: str) -> tuple[KVCacheBlock, int] | None:
        last, self._partial_hit = self._partial_hit, None
        return (last[1], last[2]) if last is not None and last[0] == request_id else None

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The step's copy-on-write block copies (source, destination): the worker runs them
        after the swap-outs and before the swap-ins and the forward. Call once per step."""
        copies, self._block_copies = self._block_copies, []
        return copies

    def _can_allocate(self, num_to_allocate: int, new_computed: list[KVCacheBlock]) -> bool:
        # Free prefix-hit blocks sit in the free queue, but touch() is about to take them out,
        # so they cannot also be handed out as fresh blocks.
        num_free_hits = sum(1 for block in new_computed if block.ref_cnt == 0)
        return num_to_allocate <= self.block_pool.get_num_free_blocks() - num_free_hits

    def _append_blocks(
        self, request_id: str, new_computed: list[KVCacheBlock], num_to_allocate: int, tier_hits: list[BlockHash]
    ) -> list[KVCacheBlock]:
        table = self.req_to_blocks.setdefault(request_id, [])
        # Prefix hits are already in the cache; caching resumes after them (and indexes the
        # swap-in blocks: their content arrives before this step's forward).
        self.num_cached_block.setdefault(request_id, len(new_computed))
        self.block_pool.touch(new_computed)
        slots = self.swap_tier.claim(tier_hits)  # before get_new_blocks may evict into the tier
        fresh = self.block_pool.get_new_blocks(num_to_allocate)
        assert len(fresh) >= len(slots), (len(fresh), len(slots))
        for slot, block in zip(slots, fresh):
            self.swap_tier.swap_in(slot, block.block_id)
        new_blocks = new_computed + fresh
        table.extend(new_blocks)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        # Index every block that is full once this step's tokens are written. Hashes cover only
        # all_token_ids, so lookahead / speculative slots are never cached before acceptance.
        if not self.enable_caching:
            return
        update_request_block_hashes(request, self.block_size)
        table = self.req_to_blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(request.block_hashes), len(table))
        num_cached = self.num_cached_block[request.request_id]
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(table, request.block_hashes, num_cached, num_full)
            self.num_cached_block[request.request_id] = num_full

    def free(self, request: Request, discard: bool = False) -> None:
        """Release the request's blocks; a no-op for a request that holds none.

        Tail blocks are freed first so that they are evicted first: a later request sharing
        this prefix is likelier to need the head blocks. ``discard``: the request failed and its
        KV may be wrong, so the blocks it held alone leave the prefix cache as they are freed.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if self._tier_hits is not None and self._tier_hits[0] == request.request_id:
            self._tier_hits = None
        if self._partial_hit is not None and self._partial_hit[0] == request.request_id:
            self._partial_hit = None
        self.num_cached_block.pop(request.request_id, None)
        if blocks is not None:
            if not discard:
                self._cache_partial_tail(request, blocks)
            self.block_pool.free_blocks(reversed(blocks), uncache=discard)

    def _cache_partial_tail(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Index the request's last, partly computed block under its computed tokens, so that a
        request continuing them (a beam of the next step, a resumed one) copies it."""
        if not self.enable_caching:
            return
        # Accepted proposals past a stop are computed but not kept: count only kept tokens.
        block_index, num_tokens = divmod(min(request.num_computed_tokens, request.num_tokens), self.block_size)
        if num_tokens and block_index < len(blocks):
            update_request_block_hashes(request, self.block_size)
            partial_hash = partial_block_hash(request, block_index, num_tokens, self.block_size)
            self.block_pool.cache_partial_block(blocks[block_index], partial_hash)

    def take_kv_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The tier copies (swap-outs, swap-ins) the step just planned needs, as (block id, slot)
        pairs; call once per step, when its SchedulerOutput is built."""
        return self.block_pool.take_kv_copies()

    def make_swap_stats(self) -> tuple[int, int]:
        """(blocks swapped out, blocks swapped in) since the last call; resets both counters."""
        return self.swap_tier.take_stats()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as physical block ids (empty if it holds none)."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Drop every prefix-cache entry; False (nothing done) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref_cnt equals the block tables referencing it."""
        self.block_pool.check_integrity()
        refs = Counter(
            block.block_id for blocks in self.req_to_blocks.values() for block in blocks if not block.is_null
        )
        errors = [
            f"block {b.block_id} has ref_cnt={b.ref_cnt} but {refs[b.block_id]} block-table references"
            for b in self.block_pool.blocks[1:]
            if b.ref_cnt != refs[b.block_id]
        ]
        if errors:
            raise RuntimeError("KV cache manager integrity check failed:\n  " + "\n  ".join(errors))
