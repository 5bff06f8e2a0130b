"""Paged KV-cache bookkeeping: blocks, LRU free queue, prefix-cache hashing, manager.

Pure Python (no torch): the scheduler runs it in the engine-core process and the tests
check it with exact block ids, no model involved.
"""

from pagedllm.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from pagedllm.kv_cache.block_pool import BlockPool
from pagedllm.kv_cache.hashing import BlockHash, hash_block_tokens, update_request_block_hashes
from pagedllm.kv_cache.manager import KVCacheManager
from pagedllm.kv_cache.swap_tier import SwapTier

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "SwapTier",
    "hash_block_tokens",
    "update_request_block_hashes",
]
