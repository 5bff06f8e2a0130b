"""The swap tier (--swap-space) with exact block ids and tier slots: no model, no torch.

Evicted cached blocks are planned as swap-outs (block id, slot), later prefix lookups that run
past the device pool's hits continue in the tier and are planned as swap-ins (block id, slot).
``take_kv_copies`` ends a step (as building a SchedulerOutput does). The free queue starts as
[1, 2, ..., num_blocks - 1]; a freed request's blocks join its tail in reverse table order.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedllm.kv_cache.block_pool import BlockPool
from pagedllm.kv_cache.hashing import hash_block_tokens
from pagedllm.kv_cache.manager import KVCacheManager
from pagedllm.kv_cache.swap_tier import SwapTier
from tests.kv_cache.test_manager import BS, admit, free_ids, make_request

A = list(range(33))  # two full blocks (hashed) and one partial
B = [1000 + i for i in range(64)]  # four full blocks
C = [2000 + i for i in range(17)]  # one full block and one partial


@pytest.fixture
def managers() -> Iterator[list[KVCacheManager]]:
    made: list[KVCacheManager] = []
    yield made
    for manager in made:
        manager.check_integrity()


def new_manager(made: list[KVCacheManager], num_blocks: int, num_swap_slots: int) -> KVCacheManager:
    manager = KVCacheManager(num_blocks, BS, num_swap_slots=num_swap_slots)
    made.append(manager)
    return manager


def tier_slots(manager: KVCacheManager, tokens: list[int]) -> list[int | None]:
    """The tier slot of each full block of ``tokens`` (None: not in the tier)."""
    slots, parent = [], None
    for i in range(len(tokens) // BS):
        parent = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS])
        slots.append(manager.swap_tier.lookup(parent))
    return slots


def run_and_free(manager: KVCacheManager, request_id: str, tokens: list[int]) -> list[int]:
    """Admit, run and free a request in one step (ending it: the step's copies are dropped)."""
    request = make_request(request_id, tokens)
    block_ids = admit(manager, request)
    assert block_ids is not None
    manager.free(request)
    manager.take_kv_copies()
    return block_ids


def test_eviction_goes_to_the_tier_and_a_lookup_restores(managers) -> None:
    manager = new_manager(managers, 5, num_swap_slots=4)
    assert run_and_free(manager, "a", A) == [1, 2, 3]
    assert free_ids(manager) == [4, 3, 2, 1]

    # B takes every block: A's cached blocks 2 (second block) and 1 (first) are evicted in
    # that order and copied out; block 3 held only a partial block, so nothing to keep.
    b = make_request("b", B)
    assert admit(manager, b) == [4, 3, 2, 1]
    assert manager.take_kv_copies() == ([(2, 0), (1, 1)], [])
    manager.free(b)
    assert tier_slots(manager, A) == [1, 0]
    assert manager.make_swap_stats() == (2, 0)

    # A again: no device hit, two tier hits (32 tokens computed), one block to compute.
    a2 = make_request("a2", A)
    hits, num_computed = manager.get_computed_blocks(a2)
    assert (hits, num_computed) == ([], 32)
    assert manager.take_kv_copies() == ([], [])  # a lookup alone plans nothing
    assert manager.allocate_slots(a2, 1, hits) == [1, 2, 3]
    # Blocks 1 and 2 (B's last two blocks) are evicted to slots 2 and 3, then receive A's two
    # blocks: a swap-in into a block evicted in the same step, after its swap-out. Block 3
    # (B's second block) finds every slot pinned this step, so it is dropped.
    assert manager.take_kv_copies() == ([(1, 2), (2, 3)], [(1, 1), (2, 0)])
    assert manager.make_swap_stats() == (2, 2)
    assert tier_slots(manager, B) == [None, None, 3, 2]
    # The swap-in blocks are indexed in the device prefix cache again.
    a3 = make_request("a3", A)
    assert [blk.block_id for blk in manager.get_computed_blocks(a3)[0]] == [1, 2]
    a2.num_computed_tokens = 33
    manager.free(a2)


def test_lru_within_the_tier(managers) -> None:
    manager = new_manager(managers, 4, num_swap_slots=2)
    x, y = ([3000 * k + i for i in range(17)] for k in (1, 2))  # one full block each
    assert run_and_free(manager, "x", x) == [1, 2]  # free queue [3, 2, 1]
    assert run_and_free(manager, "y", y) == [3, 2]  # block 1 (x) stays cached; free [1, 2, 3]
    b = make_request("b", B[:48])
    assert admit(manager, b) == [1, 2, 3]  # evicts 1 (x) and 3 (y); 2 held a partial block
    assert manager.take_kv_copies() == ([(1, 0), (3, 1)], [])
    manager.free(b)  # free queue [3, 2, 1], holding b's blocks 2, 1, 0
    assert tier_slots(manager, x) == [0] and tier_slots(manager, y) == [1]

    # A hit on x makes it the most recently used, so evicting b's block 3 takes y's slot 1;
    # then block 2's eviction finds both slots pinned this step and is dropped.
    x2 = make_request("x2", x)
    assert admit(manager, x2) == [3, 2]
    assert manager.take_kv_copies() == ([(3, 1)], [(3, 0)])
    assert tier_slots(manager, x) == [0] and tier_slots(manager, y) == [None]
    assert tier_slots(manager, B[:48]) == [None, None, 1]
    manager.free(x2)


def test_no_leak_when_the_allocation_after_a_tier_hit_fails(managers) -> None:
    manager = new_manager(managers, 5, num_swap_slots=4)
    run_and_free(manager, "a", A)
    run_and_free(manager, "b", B)  # A's blocks go to slots 0 and 1
    holder = make_request("h", C)
    assert admit(manager, holder) == [1, 2]  # two of the four blocks are in use now
    assert manager.take_kv_copies() == ([(1, 2), (2, 3)], [])

    a2 = make_request("a2", A)
    hits, num_computed = manager.get_computed_blocks(a2)
    assert (hits, num_computed) == ([], 32)
    assert manager.allocate_slots(a2, 1, hits) is None  # needs 3 blocks, 2 are free
    assert manager.take_kv_copies() == ([], [])  # no swap-in, nothing evicted
    assert manager.make_swap_stats() == (4, 0)
    assert manager.get_block_ids("a2") == [] and free_ids(manager) == [3, 4]
    assert tier_slots(manager, A) == [1, 0]  # the tier entries are intact, none pinned
    manager.check_integrity()

    # The failed lookup's hits are gone: a later allocation never counts them as computed.
    # Block 3 held B's second block: it replaces A's second block, the least recently used.
    other = make_request("o", [5000 + i for i in range(8)])
    assert manager.allocate_slots(other, 8) == [3]
    assert manager.take_kv_copies() == ([(3, 0)], [])
    manager.free(other)
    manager.free(holder)
    a3 = make_request("a3", A)
    assert admit(manager, a3) == [4, 3, 2]  # one tier hit now; B's first block takes slot 2
    assert manager.take_kv_copies() == ([(4, 2)], [(4, 1)])
    manager.free(a3)


def test_a_block_reused_twice_in_one_step_is_copied_out_once() -> None:
    tier = SwapTier(4)
    pool = BlockPool(2, enable_caching=True, swap_tier=tier)  # one usable block: 1
    [block] = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [b"one"], 0, 1)
    pool.free_blocks([block])
    assert pool.take_kv_copies() == ([], [])  # a step ends: block 1's content is settled
    assert pool.get_new_blocks(1) == [block]  # "one" evicted and copied out
    pool.cache_full_blocks([block], [b"two"], 0, 1)  # indexed now, written when the step runs
    pool.free_blocks([block])  # e.g. its request preempted in the same step
    assert pool.get_new_blocks(1) == [block]  # evicted again: no "two" content to copy yet
    assert pool.take_kv_copies() == ([(1, 0)], [])
    assert tier.lookup(b"one") == 0 and tier.lookup(b"two") is None
    pool.free_blocks([block])
    pool.check_integrity()


def test_reset_prefix_cache_empties_the_tier(managers) -> None:
    manager = new_manager(managers, 5, num_swap_slots=4)
    run_and_free(manager, "a", A)
    run_and_free(manager, "b", B)
    assert manager.swap_tier.num_used_slots == 2
    assert manager.reset_prefix_cache()
    assert manager.swap_tier.num_used_slots == 0 and tier_slots(manager, A) == [None, None]
    assert manager.get_computed_blocks(make_request("a2", A)) == ([], 0)
    run_and_free(manager, "a3", A)
    c = make_request("c", B)
    assert admit(manager, c) == [4, 3, 2, 1]
    assert manager.take_kv_copies()[0] == [(2, 1), (1, 0)]  # the recycled slots, last freed first
    manager.free(c)


def test_no_tier_without_prefix_caching() -> None:
    manager = KVCacheManager(5, BS, enable_caching=False, num_swap_slots=4)
    run_and_free(manager, "a", A)
    b = make_request("b", B)
    admit(manager, b)
    assert manager.take_kv_copies() == ([], []) and manager.swap_tier.num_slots == 0
    manager.free(b)
    manager.check_integrity()


def test_integrity_check_covers_the_tier() -> None:
    manager = KVCacheManager(5, BS, num_swap_slots=4)
    run_and_free(manager, "a", A)
    run_and_free(manager, "b", B)
    manager.check_integrity()
    tier = manager.swap_tier
    tier._slots[b"duplicate"] = tier._slots[next(iter(tier._slots))]
    with pytest.raises(RuntimeError, match="tier slot"):
        manager.check_integrity()
    with pytest.raises(ValueError, match="num_slots"):
        SwapTier(-1)
