"""Copy-on-write partial blocks, with exact block ids: a freed request's last, partly computed
block stays indexed under its computed tokens; a later request continuing them (the next beam
of a beam search) gets a fresh block plus a planned copy, never the block itself.

The free queue starts as [1, ..., num_blocks - 1]; a freed request's blocks join its tail in
reverse table order."""

from __future__ import annotations

from pagedllm.kv_cache.manager import KVCacheManager
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 16


def _request(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id, tokens, SamplingParams(), eos_token_id=None, cache_salt=salt)


def _admit(manager: KVCacheManager, request: Request) -> tuple[int, list[int] | None]:
    hits, num_computed = manager.get_computed_blocks(request)
    new_ids = manager.allocate_slots(request, request.num_tokens - num_computed, hits)
    if new_ids is not None:
        request.num_computed_tokens = request.num_tokens
    return num_computed, new_ids


def _free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def test_a_continuation_copies_the_partial_block_and_computes_one_token():
    manager = KVCacheManager(11, BS)
    parent = _request("parent", list(range(100, 120)))  # 20 tokens: one full block + 4
    assert _admit(manager, parent) == (0, [1, 2])
    manager.free(parent)
    assert _free_ids(manager)[-2:] == [2, 1]
    child = _request("child", list(range(100, 120)) + [7])
    num_computed, new_ids = _admit(manager, child)
    assert num_computed == 20 and new_ids == [1, 3]  # block 1 shared, block 3 fresh for the copy
    assert manager.take_block_copies() == [(2, 3)]
    assert manager.take_block_copies() == []  # once per step
    sibling = _request("sibling", list(range(100, 120)) + [8])  # another beam of the same parent
    assert _admit(manager, sibling) == (20, [1, 4])
    assert manager.take_block_copies() == [(2, 4)]
    assert manager.block_pool.blocks[2].ref_cnt == 0  # the source is never referenced
    for request in (child, sibling):
        manager.free(request)
    manager.check_integrity()


def test_the_copy_source_may_be_the_fresh_block_itself():
    manager = KVCacheManager(4, BS)  # blocks 1..3
    parent = _request("parent", list(range(100, 120)))
    _admit(manager, parent)
    manager.free(parent)  # free queue: [3, 2, 1]
    child = _request("child", list(range(100, 120)) + [7])
    assert _admit(manager, child) == (20, [1, 3])
    assert manager.take_block_copies() == [(2, 3)]
    manager.free(child)
    grandchild = _request("grandchild", list(range(100, 120)) + [7, 9])
    _, ids = _admit(manager, grandchild)  # the child's partial block 3 (5 tokens) is the source
    assert manager.take_block_copies() == [(3, ids[1])]
    manager.free(grandchild)
    manager.check_integrity()


def test_partial_hits_need_the_same_salt_and_an_exact_token_count():
    manager = KVCacheManager(11, BS)
    parent = _request("p", list(range(100, 120)), salt="a")
    _admit(manager, parent)
    manager.free(parent)
    other_salt = _request("q", list(range(100, 120)) + [7], salt="b")
    assert manager.get_computed_blocks(other_salt) == ([], 0)
    same = _request("r", list(range(100, 120)), salt="a")  # the same 20 tokens: 19 may be reused
    blocks, num_computed = manager.get_computed_blocks(same)
    assert num_computed == 16  # the partial entry holds 4 tokens; an exact 3 is not indexed
    manager.check_integrity()


def test_a_popped_partial_block_stops_answering_and_never_goes_to_the_tier():
    manager = KVCacheManager(5, BS, num_swap_slots=4)  # blocks 1..4
    parent = _request("parent", list(range(100, 120)))
    _admit(manager, parent)
    manager.free(parent)  # free queue [3, 4, 2, 1]: block 2 partial, block 1 full
    filler = _request("filler", list(range(500, 548)))  # 3 fresh blocks: 3, 4, then 2 (partial)
    assert _admit(manager, filler) == (0, [3, 4, 2])
    swap_out, _ = manager.take_kv_copies()
    assert swap_out == []  # block 2 was only a partial entry: nothing to save
    child = _request("child", list(range(100, 120)) + [7])
    assert manager.get_computed_blocks(child)[1] == 16  # block 1's full hit only
    manager.free(filler)
    manager.check_integrity()
