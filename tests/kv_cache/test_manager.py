"""KVCacheManager: block tables, prefix hits and eviction order with exact block ids.

Each test drives the manager the way the scheduler does: get_computed_blocks on admission,
allocate_slots, then set request.num_computed_tokens; the integrity check runs after every test.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from pagedllm.kv_cache.manager import KVCacheManager
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 16


def make_request(request_id: str, token_ids: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, token_ids, SamplingParams(), eos_token_id=None, cache_salt=cache_salt)


def admit(manager: KVCacheManager, request: Request) -> list[int] | None:
    """Prefix lookup + allocation for the whole remaining prompt, as on scheduler admission."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit_tokens
    new_ids = manager.allocate_slots(request, num_new, hits)
    if new_ids is not None:
        request.num_computed_tokens = num_hit_tokens + num_new
    return new_ids


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


@pytest.fixture
def managers() -> Iterator[list[KVCacheManager]]:
    """Collects the managers a test builds and checks their integrity when it ends."""
    made: list[KVCacheManager] = []
    yield made
    for manager in made:
        manager.check_integrity()


def new_manager(made: list[KVCacheManager], num_blocks: int, caching: bool = True) -> KVCacheManager:
    manager = KVCacheManager(num_blocks, BS, enable_caching=caching)
    made.append(manager)
    return manager


def test_conformance_shared_prefix_and_free_order(managers: list[KVCacheManager]) -> None:
    manager = new_manager(managers, 11)
    a = make_request("A", list(range(55)))
    assert manager.get_computed_blocks(a) == ([], 0)
    assert manager.allocate_slots(a, 55) == [1, 2, 3, 4]
    a.num_computed_tokens = 55

    b = make_request("B", list(range(48)) + [1000 + i for i in range(7)])
    hits, num_computed = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2, 3] and num_computed == 48
    assert manager.allocate_slots(b, 7, hits) == [1, 2, 3, 5]
    b.num_computed_tokens = 55
    assert manager.get_block_ids("B") == [1, 2, 3, 5]
    manager.check_integrity()

    manager.free(a)
    manager.free(b)
    assert free_ids(manager) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]
    manager.check_integrity()


def test_full_prompt_hit_leaves_one_token_to_compute(managers: list[KVCacheManager]) -> None:
    manager = new_manager(managers, 6)
    admit(manager, make_request("X", list(range(32))))
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    y = make_request("Y", list(range(32)))
    hits, num_computed = manager.get_computed_blocks(y)
    assert [blk.block_id for blk in hits] == [1] and num_computed == 16
    assert manager.allocate_slots(y, 16, hits) == [1, 3]


def test_cache_salt_isolates_prefixes(managers: list[KVCacheManager]) -> None:
    manager = new_manager(managers, 10)
    tokens = list(range(40))
    admit(manager, make_request("s1", tokens, cache_salt="alice"))
    assert manager.get_computed_blocks(make_request("s2", tokens, cache_salt="bob"))[1] == 0
    assert manager.get_computed_blocks(make_request("s3", tokens))[1] == 0
    assert manager.get_computed_blocks(make_request("s4", tokens, cache_salt="alice"))[1] == 32


def test_prefix_cache_stats(managers: list[KVCacheManager]) -> None:
    manager = new_manager(managers, 10)
    admit(manager, make_request("a", list(range(40))))
    admit(manager, make_request("b", list(range(40))))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (80, 32)
    assert manager.make_prefix_cache_stats() == (80, 32)
    assert manager.make_prefix_cache_stats() == (0, 0)


def test_lru_eviction_of_cached_free_blocks(managers: list[KVCacheManager]) -> None:
    manager = new_manager(managers, 5)
    a = make_request("a", list(range(32)))
    admit(manager, a)
    hashes = list(a.block_hashes)
    manager.free(a)
    assert free_ids(manager) == [3, 4, 2, 1]
    # An unrelated 33-token prompt needs 3 blocks, taken from the queue head: 3 and 4 (never
    # used) and then cached block 2 (freed before 1 because tails are freed first).
    b = make_request("b", [500 + i for i in range(33)])
    assert admit(manager, b) == [3, 4, 2]
    cache = manager.block_pool.cached_block_hash_to_block
    assert hashes[1] not in cache and cache[hashes[0]].block_id == 1
    assert free_ids(manager) == [1]
    manager.free(b)


def test_failed_allocation_changes_nothing(managers: list[KVCacheManager]) -> None:
    manager = new_manager(managers, 5)
    a = make_request("a", list(range(33)))
    assert admit(manager, a) == [1, 2, 3]
    manager.free(a)
    assert free_ids(manager) == [4, 3, 2, 1]
    # 72 tokens need 5 blocks: 2 prefix hits (both free) + 3 new, but the hits themselves
    # occupy 2 of the 4 free slots, so only 2 fresh blocks exist.
    b = make_request("b", list(range(32)) + [700 + i for i in range(40)])
    hits, num_computed = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2] and num_computed == 32
    assert manager.allocate_slots(b, 40, hits) is None
    assert free_ids(manager) == [4, 3, 2, 1] and manager.num_free_blocks == 4
    assert manager.get_block_ids("b") == [] and all(blk.ref_cnt == 0 for blk in hits)
    manager.check_integrity()
    # 62 tokens fit: hits [1, 2] leave the queue via touch, then 4 and 3 are popped.
    c = make_request("c", list(range(32)) + [700 + i for i in range(30)])
    assert admit(manager, c) == [1, 2, 4, 3]
    assert manager.num_free_blocks == 0 and manager.usage == 1.0


def test_decode_caches_blocks_as_they_fill(managers: list[KVCacheManager]) -> None:
    manager = new_manager(managers, 6)
    r = make_request("r", list(range(20)))
    assert admit(manager, r) == [1, 2]
    cache = manager.block_pool.cached_block_hash_to_block
    assert len(r.block_hashes) == 1 and len(cache) == 1
    for step in range(13):  # decode tokens 20..32; the step computing token 31 fills block 2
        r.append_output_token_ids([900 + step])
        new_ids = manager.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        assert new_ids == ([3] if r.num_tokens == 33 else [])
        assert len(cache) == (1 if r.num_tokens < 32 else 2)
    assert len(r.block_hashes) == 2 and cache[r.block_hashes[1]].block_id == 2
    assert manager.num_cached_block["r"] == 2


def test_lookahead_slots_are_allocated_not_cached(managers: list[KVCacheManager]) -> None:
    manager = new_manager(managers, 8)
    r = make_request("r", list(range(30)))
    assert manager.allocate_slots(r, 30, num_lookahead_tokens=4) == [1, 2, 3]
    r.num_computed_tokens = 30
    assert len(manager.block_pool.cached_block_hash_to_block) == 1
    assert manager.allocate_slots(r, 1, num_lookahead_tokens=2) == []  # slots already there


def test_preempted_request_resumes_from_its_own_cached_output(managers: list[KVCacheManager]) -> None:
    manager = new_manager(managers, 6)
    r = make_request("r", list(range(20)))
    admit(manager, r)
    r.append_output_token_ids(list(range(100, 113)))  # 33 tokens: two full blocks
    manager.allocate_slots(r, 13)
    manager.free(r)  # preemption: recompute from scratch, reusing what is still cached
    r.num_computed_tokens = 0
    # Blocks 1 and 2 hit; partial block 3 was never cached, so a fresh block is taken.
    assert admit(manager, r) == [1, 2, 4] and r.num_computed_tokens == 33
    assert manager.make_prefix_cache_stats() == (20 + 33, 32)


def test_free_is_idempotent(managers: list[KVCacheManager]) -> None:
    manager = new_manager(managers, 4)
    r = make_request("r", list(range(5)))
    admit(manager, r)
    manager.free(r)
    manager.free(r)
    manager.free(make_request("never-seen", [1]))
    assert manager.num_free_blocks == 3 and manager.get_block_ids("r") == []


def test_caching_disabled(managers: list[KVCacheManager]) -> None:
    manager = new_manager(managers, 6, caching=False)
    admit(manager, make_request("a", list(range(40))))
    assert manager.get_computed_blocks(make_request("b", list(range(40)))) == ([], 0)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.make_prefix_cache_stats() == (0, 0)


def test_reset_prefix_cache(managers: list[KVCacheManager]) -> None:
    manager = new_manager(managers, 6)
    a = make_request("a", list(range(40)))
    admit(manager, a)
    assert manager.reset_prefix_cache() is False
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", list(range(40)))) == ([], 0)


def test_integrity_check_detects_bumped_ref_cnt() -> None:
    manager = KVCacheManager(6, BS)
    admit(manager, make_request("a", list(range(40))))
    manager.check_integrity()
    manager.req_to_blocks["a"][0].ref_cnt += 1  # pool invariants still hold; the tables don't
    with pytest.raises(RuntimeError, match="block 1 has ref_cnt=2 but 1"):
        manager.check_integrity()


def test_invalid_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)


def test_kv_cache_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None; "
        "import pagedllm.kv_cache.manager, pagedllm.kv_cache"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_discarded_request_leaves_the_prefix_cache_but_shared_blocks_stay(managers: list[KVCacheManager]) -> None:
    """A failed request's KV may be wrong: the blocks only it held stop answering lookups when it
    is freed with discard=True; a block another request still holds keeps its index entry."""
    manager = new_manager(managers, 8)
    a = make_request("A", list(range(40)))
    assert admit(manager, a) == [1, 2, 3]
    b = make_request("B", list(range(16)) + [900 + i for i in range(20)])
    assert admit(manager, b) == [1, 4, 5]  # shares A's first block
    manager.free(a, discard=True)
    assert free_ids(manager) == [6, 7, 3, 2]
    assert [blk.block_id for blk in manager.block_pool.cached_block_hash_to_block.values()] == [1, 4]
    assert manager.block_pool.num_partial_blocks == 0  # no partial tail indexed for a discarded request
    again = make_request("A2", list(range(40)))
    assert manager.get_computed_blocks(again)[1] == 16  # only the shared block still hits
    manager.free(b)
