"""KV-cache blocks and the O(1) LRU free-block queue (torch-free)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.kv_cache.hashing import BlockHash


# eq=False: blocks are compared by identity. Field-wise equality would be wrong (two blocks are
# never interchangeable) and would recurse through the free-queue links.
@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block of KV memory: ``block_size`` token slots in every layer's cache."""

    block_id: int
    # Number of requests whose block table holds this block; 0 means it sits in the free queue.
    ref_cnt: int = 0
    # Content hash while the block is indexed in the prefix cache, else None.
    block_hash: BlockHash | None = None
    # Intrusive links of FreeKVCacheBlockQueue; both None while the block is not in the queue.
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)
    # The reserved block 0: a placeholder for skipped positions, never allocated or freed.
    is_null: bool = False
    # Cached under a partial block's hash (a freed request's last, partly filled block): a later
    # request whose tokens continue it gets a copy (copy-on-write), never the block itself.
    is_partial: bool = False


class FreeKVCacheBlockQueue:
    """Free blocks as an intrusive doubly linked list, head = next to evict (LRU order).

    The links live in the blocks themselves, so removing a block from the middle (a prefix-cache
    hit on a free cached block) is O(1) without a lookup. Fake head and tail sentinels mean no
    operation has to special-case an empty list or an end node.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block."""
        first = self._head.next_free_block
        if first is self._tail:
            raise ValueError("No free blocks available")
        assert first is not None
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the ``n`` least recently freed blocks, in eviction order."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue, in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"Block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail: it becomes the last candidate for eviction."""
        assert block.prev_free_block is None and block.next_free_block is None, block
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append ``blocks`` to the tail in the given order."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks from head to tail, i.e. in eviction order (O(n); tests and checks)."""
        blocks = []
        node = self._head.next_free_block
        while node is not None and node is not self._tail:
            blocks.append(node)
            node = node.next_free_block
        return blocks

    def __len__(self) -> int:
        return self.num_free_blocks
