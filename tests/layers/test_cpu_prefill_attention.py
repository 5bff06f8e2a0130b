"""The CPU prefill attention kernel (csrc/cpu_prefill_attention.cpp) on every ISA level against
dense causal attention in float64 over the same cache: chunks from scratch and on a cached
prefix, grouped-query head counts, block sizes, sliding windows, 16-bit caches, strided queries."""

import math

import pytest
import torch

DIM_CASES = [
    # (tokens, context, heads, kv_heads, dim, block_size, window)
    (1, 0, 9, 3, 64, 16, 0),  # one row: its own key only
    (5, 0, 9, 3, 64, 16, 0),  # fewer units than a tile
    (37, 0, 9, 3, 64, 16, 0),  # tiles mixing rows, a partial last tile
    (64, 100, 9, 3, 64, 16, 0),  # a chunk on a cached prefix that is not block-aligned
    (130, 7, 4, 4, 32, 16, 0),  # one query head per KV head
    (20, 40, 8, 2, 128, 8, 0),  # 4 query heads per KV head, 128 features, blocks of 8
    (50, 30, 9, 3, 64, 16, 17),  # a sliding window inside the chunk and the prefix
    (33, 0, 6, 3, 16, 4, 5),  # 16 features, blocks of 4, a short window
    (90, 0, 2, 1, 16, 16, 200),  # a window longer than the sequence: no effect
]


def _dense(q, kc, vc, table, context, scale, window):
    """[T, H, D] float64 attention of the chunk's rows over positions 0..context+T-1 of the cache."""
    tokens, heads, dim = q.shape
    block, kv_heads = kc.shape[1], kc.shape[2]
    length = context + tokens
    pos = torch.arange(length)
    slots = table[pos // block] * block + pos % block
    k = kc.reshape(-1, kv_heads, dim)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
    v = vc.reshape(-1, kv_heads, dim)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(context, length)[:, None]
    visible = pos[None, :] <= qpos
    if window > 0:
        visible &= pos[None, :] > qpos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _case(isa_ops, tokens, context, heads, kv_heads, dim, block, window, cache_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = (context + tokens + block - 1) // block
    kc = torch.randn(blocks + 3, block, kv_heads, dim, generator=gen).to(cache_dtype)
    vc = torch.randn(blocks + 3, block, kv_heads, dim, generator=gen).to(cache_dtype)
    table = torch.randperm(blocks + 3, generator=gen)[:blocks]  # blocks anywhere in the pool
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)  # q: a strided view, as in a model
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    out = torch.full((tokens, heads, dim), float("nan"))
    scale = 1 / math.sqrt(dim)
    isa_ops.paged_prefill_attention(out, q, kc, vc, table, context, scale, window)
    return out, _dense(q, kc, vc, table, context, scale, window)


@pytest.mark.parametrize("case", DIM_CASES, ids=lambda c: "T{}-ctx{}-H{}-KVH{}-D{}-B{}-W{}".format(*c))
def test_matches_dense_attention(isa_ops, case):
    out, reference = _case(isa_ops, *case)
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_16_bit_caches_are_widened(isa_ops, cache_dtype):
    out, reference = _case(isa_ops, 70, 20, 9, 3, 64, 16, 0, cache_dtype=cache_dtype)
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_clear_errors(isa_ops):
    q = torch.randn(4, 4, 16)
    kc = vc = torch.zeros(2, 4, 2, 16)
    table = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="block table holds 2 blocks"):
        isa_ops.paged_prefill_attention(torch.empty_like(q), q, kc, vc, table, 5, 0.25, 0)
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        isa_ops.paged_prefill_attention(torch.empty(4, 3, 16), torch.randn(4, 3, 16), kc, vc, table, 0, 0.25, 0)
    with pytest.raises(RuntimeError, match="int64"):
        isa_ops.paged_prefill_attention(torch.empty_like(q), q, kc, vc, table.int(), 0, 0.25, 0)
    with pytest.raises(RuntimeError, match="float32 queries"):
        isa_ops.paged_prefill_attention(torch.empty_like(q).bfloat16(), q.bfloat16(), kc, vc, table, 0, 0.25, 0)
