"""FreeKVCacheBlockQueue, hashing and BlockPool, with exact block ids and queue order."""

from __future__ import annotations

import pytest

from pagedllm.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from pagedllm.kv_cache.block_pool import BlockPool
from pagedllm.kv_cache.hashing import hash_block_tokens


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


# ---- FreeKVCacheBlockQueue ---------------------------------------------------------------


def test_queue_initial_order_and_popleft() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5 and ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert queue.popleft().block_id == 0
    assert ids(queue.popleft_n(2)) == [1, 2]
    assert queue.num_free_blocks == 2 and ids(queue.get_all_free_blocks()) == [3, 4]
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None


def test_queue_remove_middle_head_tail_and_append() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue.get_all_free_blocks()) == [1, 3] and queue.num_free_blocks == 2
    queue.append(blocks[2])
    queue.append_n([blocks[0], blocks[4]])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 2, 0, 4] and len(queue) == 5


def test_queue_empty_and_errors() -> None:
    queue = FreeKVCacheBlockQueue([])
    assert queue.get_all_free_blocks() == [] and queue.num_free_blocks == 0
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft_n(1)
    with pytest.raises(ValueError):
        queue.remove(KVCacheBlock(7))  # not in the queue
    queue.append(KVCacheBlock(7))
    assert ids(queue.popleft_n(1)) == [7] and queue.num_free_blocks == 0


def test_queue_drain_and_refill_keeps_links_consistent() -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    popped = queue.popleft_n(3)
    assert queue.num_free_blocks == 0 and queue.get_all_free_blocks() == []
    queue.append_n(reversed(popped))
    assert ids(queue.get_all_free_blocks()) == [2, 1, 0]


# ---- hashing -----------------------------------------------------------------------------


def test_hash_is_deterministic_and_chained() -> None:
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert h1 == hash_block_tokens(None, [1, 2, 3]) and isinstance(h1, bytes)
    assert h1 != hash_block_tokens(None, [1, 2, 4])
    assert hash_block_tokens(h1, [4, 5]) != hash_block_tokens(None, [4, 5])
    assert hash_block_tokens(None, [1], ("salt",)) != hash_block_tokens(None, [1])


def test_hash_stable_known_value() -> None:
    # Pinned: hashes must not depend on the process (PYTHONHASHSEED) or change by accident,
    # or caches shared across processes would silently stop matching.
    expected = "6db53a0f6187f44862c2d00287e497129f048dffb3d3e348e2d891bea7d95d47"
    assert hash_block_tokens(None, [1, 2, 3]).hex() == expected


# ---- BlockPool ---------------------------------------------------------------------------


def test_pool_initial_state() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block.is_null and pool.null_block.block_id == 0
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    pool.check_integrity()
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=True)


def test_get_new_blocks_and_free_order() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3] and all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_usage() == pytest.approx(3 / 5)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2  # the failed call changed nothing
    pool.free_blocks([blocks[2], pool.null_block, blocks[0], blocks[1]])
    assert free_ids(pool) == [4, 5, 3, 1, 2]
    pool.check_integrity()


def _cache(pool: BlockPool, blocks: list[KVCacheBlock], tag: int) -> list[bytes]:
    hashes = [hash_block_tokens(None, [tag, i]) for i in range(len(blocks))]
    pool.cache_full_blocks(blocks, hashes, 0, len(blocks))
    return hashes


def test_cached_free_blocks_evicted_in_lru_order() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = _cache(pool, blocks, tag=0)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1]
    assert pool.get_cached_block(hashes[0]) is blocks[0]  # free but still cached
    evicted = pool.get_new_blocks(2)
    assert ids(evicted) == [3, 2]
    assert pool.get_cached_block(hashes[2]) is None and pool.get_cached_block(hashes[1]) is None
    assert evicted[0].block_hash is None
    assert set(pool.cached_block_hash_to_block) == {hashes[0]}
    pool.check_integrity()


def test_touch_removes_free_cached_block_from_queue() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    _cache(pool, blocks, tag=1)
    pool.free_blocks(blocks)
    assert free_ids(pool) == [3, 1, 2]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and free_ids(pool) == [3, 2]
    pool.touch([blocks[0]])  # already in use: only the count moves
    assert blocks[0].ref_cnt == 2 and free_ids(pool) == [3, 2]
    pool.check_integrity()


def test_duplicate_hash_keeps_first_block_indexed() -> None:
    pool = BlockPool(4, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [9])
    pool.cache_full_blocks([first], [h], 0, 1)
    pool.cache_full_blocks([second], [h], 0, 1)
    assert pool.get_cached_block(h) is first and second.block_hash is None
    pool.check_integrity()


def test_caching_disabled_is_noop() -> None:
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    _cache(pool, blocks, tag=2)
    assert pool.cached_block_hash_to_block == {} and blocks[0].block_hash is None


def test_reset_prefix_cache_only_when_all_free() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    _cache(pool, blocks, tag=3)
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {} and all(b.block_hash is None for b in blocks)
    pool.check_integrity()


@pytest.mark.parametrize("corrupt", ["bump_ref", "negative_ref", "stale_hash", "orphan_hash"])
def test_integrity_check_detects_corruption(corrupt: str) -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = _cache(pool, blocks, tag=4)
    pool.free_blocks([blocks[1]])
    if corrupt == "bump_ref":
        blocks[1].ref_cnt += 1  # in use, yet still in the free queue
    elif corrupt == "negative_ref":
        blocks[0].ref_cnt = -1
    elif corrupt == "stale_hash":
        pool.cached_block_hash_to_block[hashes[0]] = blocks[1]
    else:
        pool.blocks[3].block_hash = b"not indexed"
    with pytest.raises(RuntimeError, match="integrity"):
        pool.check_integrity()
