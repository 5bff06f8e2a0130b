"""Content hashes of full KV blocks, chained to the parent block (torch-free).

A block's hash covers its own tokens and its parent's hash, so equal hashes mean equal whole
prefixes, not just equal blocks. SHA-256 over a fixed byte encoding (never Python's ``hash()``,
which is salted per process) keeps hashes stable across processes and restarts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.request import Request

BlockHash = bytes

# Marks a block with no parent, so a first block can never collide with a chained one.
_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    """Hash one block of ``token_ids`` chained to ``parent_hash`` (None for the first block).

    ``extra_keys`` (e.g. a cache salt) must have a deterministic ``repr``.
    """
    h = hashlib.sha256()
    h.update(_NO_PARENT if parent_hash is None else _HAS_PARENT + parent_hash)
    # The length prefix keeps the token bytes and the extra-keys text from running together.
    h.update(len(token_ids).to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    h.update(repr(extra_keys).encode())
    return h.digest()


def _first_block_extra_keys(request: Request) -> tuple | None:
    # The salt and the LoRA adapter go into the first block only: chaining carries them into
    # every later hash, so two adapters (or an adapter and the base model) never share a block.
    keys: tuple = () if request.cache_salt is None else (request.cache_salt,)
    lora = request.lora_request
    if lora is not None:
        keys += (("lora", lora.lora_int_id, lora.lora_name),)
    return keys or None


def update_request_block_hashes(request: Request, block_size: int) -> None:
    """Append to ``request.block_hashes`` the hashes of full blocks not hashed yet.

    Incremental: called every step, it hashes only blocks that filled since the last call.
    """
    hashes = request.block_hashes
    tokens = request.all_token_ids
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), len(tokens) // block_size):
        extra = _first_block_extra_keys(request) if i == 0 else None
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)


def partial_block_hash(request: Request, block_index: int, num_tokens: int, block_size: int) -> BlockHash:
    """The hash of the first ``num_tokens`` (< block_size) tokens of the request's block
    ``block_index``, chained like a full block's (its length is hashed too, so it never equals
    one). ``request.block_hashes`` must cover the blocks before it."""
    assert 0 < num_tokens < block_size, num_tokens
    start = block_index * block_size
    parent = request.block_hashes[block_index - 1] if block_index else None
    extra = _first_block_extra_keys(request) if block_index == 0 else None
    return hash_block_tokens(parent, request.all_token_ids[start : start + num_tokens], extra)
