"""The fused CPU ops (csrc/cpu_fused_ops.cpp) against their torch reference paths, on every ISA
level this CPU executes (the ``isa_ops`` fixture, as ``kernels``)."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.attention.backends.base import write_kv
from pagedllm.layers.attention.backends.torch_sdpa import KVCacheWrite


@pytest.fixture
def kernels(isa_ops):
    return isa_ops


def test_silu_and_mul_matches_torch(kernels):
    x = torch.randn(7, 2 * 96) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    strided = torch.randn(5, 2 * 96 + 8)[:, : 2 * 96]  # a row stride wider than the row
    gate, up = strided.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(strided), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_silu_and_mul_vector_exp_over_the_whole_range(kernels):
    # 100 features: six 16-wide vectors and a scalar tail; gates from far negative to far
    # positive, past where e^-g under- or overflows in float32.
    gate = torch.linspace(-120, 120, 3 * 100).reshape(3, 100)
    up = torch.randn(3, 100)
    out = kernels.silu_and_mul(torch.cat([gate, up], dim=-1))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_cache_matches_index_copy(kernels, cache_dtype):
    """float32 K/V into a float32 cache, or a 16-bit one (--kv-cache-dtype) rounded as torch's
    .to() rounds: bitwise the reference write_kv. 19 tokens: a batch the kernel splits over threads,
    with padding rows (slot -1) among them."""
    blocks, block_size, kv_heads, dim = 6, 4, 2, 8
    qkv = torch.randn(19, (4 + 2 * kv_heads) * dim) * 1e3  # k and v are strided views, as in the models
    k, v = qkv[:, 4 * dim : (4 + kv_heads) * dim], qkv[:, (4 + kv_heads) * dim :]
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(0))[:19]
    slots[[2, 11]] = -1
    fused = torch.zeros(2, blocks, block_size, kv_heads, dim, dtype=cache_dtype)
    kernels.write_kv_cache(k, v, fused, slots)
    reference = torch.zeros_like(fused)
    keep = slots >= 0
    write_kv(reference, k[keep], v[keep], slots[keep])
    assert torch.equal(fused, reference) and fused.any()
    skipped = torch.zeros_like(fused)
    kernels.write_kv_cache(k, v, skipped, torch.full((19,), -1))  # padding rows write nothing
    assert not skipped.any()


def test_write_kv_cache_rejects_what_it_cannot_write(kernels):
    k = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="cache must be float32, bfloat16 or float16"):
        kernels.write_kv_cache(k, k, torch.zeros(2, 2, 4, 1, 8, dtype=torch.float64), torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="float32 keys and values only"):
        kernels.write_kv_cache(k.bfloat16(), k.bfloat16(), torch.zeros(2, 2, 4, 1, 8), torch.tensor([0, 5]))


def test_write_kv_uses_the_kernel_only_for_float32_cpu():
    """The kernel takes float32 K/V, into a cache of any dtype it writes (--kv-cache-dtype); a
    16-bit model's K/V go through the torch reference."""
    write = KVCacheWrite()
    cache = torch.zeros(2, 2, 4, 1, 8, dtype=torch.bfloat16)
    k = torch.randn(2, 8, dtype=torch.bfloat16)
    write(cache, k, k, torch.tensor([0, 5]))
    assert write.forward_method == write.forward_native and torch.equal(cache[0].view(-1, 8)[5], k[1])
    for cache_dtype in (torch.float32, torch.bfloat16):
        write32 = KVCacheWrite()
        cache = torch.zeros(2, 2, 4, 1, 8, dtype=cache_dtype)
        k = torch.randn(2, 8)
        write32(cache, k, k, torch.tensor([0, 5]))
        assert write32.forward_method == write32.forward_cpu and torch.equal(
            cache[0].view(-1, 8)[5], k[1].to(cache_dtype)
        )


@pytest.mark.parametrize("hidden", [576, 102])  # whole vectors; vectors and a scalar tail on every level
def test_rms_norm_kernels_match_torch(kernels, hidden):
    x, residual, weight = torch.randn(9, hidden) * 3, torch.randn(9, hidden), torch.rand(hidden) + 0.5
    out = torch.empty_like(x)
    kernels.rms_norm(out, x, weight, 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (hidden,), weight, 1e-5), rtol=1e-5, atol=1e-5)
    h, r = x.clone(), residual.clone()
    kernels.fused_add_rms_norm_(h, r, weight, 1e-5)
    torch.testing.assert_close(r, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(h, F.rms_norm(x + residual, (hidden,), weight, 1e-5), rtol=1e-5, atol=1e-5)


def test_decode_attention_reads_a_strided_query(kernels):
    """The kernel takes q as a view of the fused qkv rows; the result equals a contiguous copy's."""
    heads, kv_heads, dim, block = 4, 2, 16, 4
    cache = torch.randn(2, 6, block, kv_heads, dim)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(3, heads, dim)
    table = torch.tensor([[1, 2, 3], [4, 5, 0], [2, 1, 0]])
    lens = torch.tensor([9, 5, 8])
    strided, dense = torch.empty(3, heads, dim), torch.empty(3, heads, dim)
    kernels.paged_decode_attention(strided, q, cache[0], cache[1], table, lens, 0.25, 0)
    kernels.paged_decode_attention(dense, q.contiguous(), cache[0], cache[1], table, lens, 0.25, 0)
    assert torch.equal(strided, dense)


# 64: whole vectors on every level; 40: the scalar path on avx512 (40 % 16 != 0) and an output
# tile of 5 vectors on avx2; 128: two output tiles on avx2 and neon.
@pytest.mark.parametrize("dim", [64, 40, 128])
@pytest.mark.parametrize("window", [0, 37])
def test_decode_attention_matches_sdpa_on_long_contexts(kernels, dim, window):
    """Contexts from 1 to 300 tokens over shuffled blocks: the vectorised softmax runs in
    16-wide steps plus a tail, and the prefetches reach past the last position."""
    torch.manual_seed(0)
    heads, kv_heads, block = 9, 3, 16
    lens = torch.tensor([1, 17, 300, 129])
    blocks_each = -(-lens.max().item() // block)
    order = torch.randperm(len(lens) * blocks_each) + 1  # block 0 stays the null block
    table = order.view(len(lens), blocks_each)
    cache = torch.randn(2, len(order) + 1, block, kv_heads, dim)
    q = torch.randn(len(lens), heads, dim)
    out = torch.empty_like(q)
    kernels.paged_decode_attention(out, q, cache[0], cache[1], table, lens, dim**-0.5, window)
    for b, n in enumerate(lens.tolist()):
        keys = cache[0][table[b]].reshape(-1, kv_heads, dim)[:n]
        values = cache[1][table[b]].reshape(-1, kv_heads, dim)[:n]
        first = max(0, n - window) if window else 0
        ref = F.scaled_dot_product_attention(
            q[b, :, None],
            keys[first:].transpose(0, 1),
            values[first:].transpose(0, 1),
            scale=dim**-0.5,
            enable_gqa=True,
        )[:, 0]
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)


# 64: whole vectors on every level; 40: the scalar path on avx512, 5 vectors on avx2.
@pytest.mark.parametrize("dim", [64, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_on_16_bit_caches(kernels, dim, dtype):
    """bfloat16 / float16 models: K and V widened to float32 as they are loaded, sums in float32,
    the output rounded once. Against SDPA in float32 on the same (exactly widened) values."""
    torch.manual_seed(1)
    heads, kv_heads, block = 9, 3, 16
    lens = torch.tensor([1, 40, 300])
    blocks_each = -(-lens.max().item() // block)
    order = torch.randperm(len(lens) * blocks_each) + 1
    table = order.view(len(lens), blocks_each)
    cache = torch.randn(2, len(order) + 1, block, kv_heads, dim).to(dtype)
    q = torch.randn(len(lens), heads, dim).to(dtype)
    out = torch.empty_like(q)
    kernels.paged_decode_attention(out, q, cache[0], cache[1], table, lens, dim**-0.5, 0)
    assert out.dtype == dtype
    for b, n in enumerate(lens.tolist()):
        keys = cache[0][table[b]].reshape(-1, kv_heads, dim)[:n].float()
        values = cache[1][table[b]].reshape(-1, kv_heads, dim)[:n].float()
        ref = F.scaled_dot_product_attention(
            q[b, :, None].float(), keys.transpose(0, 1), values.transpose(0, 1), scale=dim**-0.5, enable_gqa=True
        )[:, 0]
        # The output's own rounding (2^-8 relative for bfloat16, 2^-11 for float16) and a little more.
        eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
        torch.testing.assert_close(out[b].float(), ref, rtol=2 * eps, atol=1e-3 * eps)


@pytest.mark.parametrize("dim", [64, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_float32_queries_on_16_bit_caches(kernels, dim, dtype):
    """--kv-cache-dtype on a float32 model: float32 queries and output over a 16-bit cache, each K/V
    value widened exactly. Against SDPA in float32 on the widened cache, to float32 accuracy."""
    torch.manual_seed(2)
    heads, kv_heads, block = 9, 3, 16
    lens = torch.tensor([1, 40, 300])
    blocks_each = -(-lens.max().item() // block)
    table = (torch.randperm(len(lens) * blocks_each) + 1).view(len(lens), blocks_each)
    cache = torch.randn(2, table.numel() + 1, block, kv_heads, dim).to(dtype)
    q = torch.randn(len(lens), heads, dim)
    out = torch.empty_like(q)
    kernels.paged_decode_attention(out, q, cache[0], cache[1], table, lens, dim**-0.5, 0)
    for b, n in enumerate(lens.tolist()):
        keys = cache[0][table[b]].reshape(-1, kv_heads, dim)[:n].float()
        values = cache[1][table[b]].reshape(-1, kv_heads, dim)[:n].float()
        ref = F.scaled_dot_product_attention(
            q[b, :, None], keys.transpose(0, 1), values.transpose(0, 1), scale=dim**-0.5, enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="reads a cache of its own dtype"):
        kernels.paged_decode_attention(
            out.to(dtype), q.to(dtype), cache[0].float(), cache[1].float(), table, lens, 1.0, 0
        )


@pytest.fixture
def num_threads():
    """Sets torch's intra-op thread count for the test, restoring it after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# 64: whole vectors on every level; 40: the scalar path on avx512, 5 vectors on avx2.
@pytest.mark.parametrize("dim", [64, 40])
@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("lens", [[1000], [700, 5], [300, 260, 40]])
def test_decode_attention_cuts_few_long_sequences_into_pieces(kernels, num_threads, dim, window, threads, lens):
    """Fewer sequences than two per thread with long contexts: each sequence's positions are cut
    into up to one piece per thread, each piece's softmax sums merged after. The result is one
    softmax over all positions (against SDPA), for every thread count and window."""
    num_threads(threads)
    torch.manual_seed(3)
    heads, kv_heads, block = 9, 3, 16
    lens = torch.tensor(lens)
    blocks_each = -(-lens.max().item() // block)
    table = (torch.randperm(len(lens) * blocks_each) + 1).view(len(lens), blocks_each)
    cache = torch.randn(2, table.numel() + 1, block, kv_heads, dim)
    q = torch.randn(len(lens), heads, dim) * 3  # peaked softmaxes: the pieces' maxima differ
    out = torch.empty_like(q)
    kernels.paged_decode_attention(out, q, cache[0], cache[1], table, lens, dim**-0.5, window)
    for b, n in enumerate(lens.tolist()):
        first = max(0, n - window) if window else 0
        keys = cache[0][table[b]].reshape(-1, kv_heads, dim)[first:n]
        values = cache[1][table[b]].reshape(-1, kv_heads, dim)[first:n]
        ref = F.scaled_dot_product_attention(
            q[b, :, None], keys.transpose(0, 1), values.transpose(0, 1), scale=dim**-0.5, enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)
    if len(lens) == 1:  # a 16-bit model's pieces: merged in float32, rounded once
        out16 = torch.empty_like(q, dtype=torch.bfloat16)
        cache16 = cache.bfloat16()
        kernels.paged_decode_attention(out16, q.bfloat16(), cache16[0], cache16[1], table, lens, dim**-0.5, window)
        first = max(0, lens[0].item() - window) if window else 0
        keys = cache16[0][table[0]].reshape(-1, kv_heads, dim)[first : lens[0]].float()
        values = cache16[1][table[0]].reshape(-1, kv_heads, dim)[first : lens[0]].float()
        ref = F.scaled_dot_product_attention(
            q[0, :, None].bfloat16().float(),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            scale=dim**-0.5,
            enable_gqa=True,
        )[:, 0]
        torch.testing.assert_close(out16[0].float(), ref, rtol=2 * 2**-8, atol=1e-5)


def test_decode_attention_of_an_empty_context_is_zero(kernels):
    """A sequence with nothing to attend to (length 0) gets zeros, an empty sum, beside others."""
    cache = torch.randn(2, 4, 16, 3, 64)
    q = torch.randn(2, 9, 64)
    out = torch.full_like(q, float("nan"))
    kernels.paged_decode_attention(
        out, q, cache[0], cache[1], torch.tensor([[1, 2], [3, 0]]), torch.tensor([0, 20]), 0.125, 0
    )
    assert torch.equal(out[0], torch.zeros(9, 64)) and torch.isfinite(out[1]).all() and out[1].abs().sum() > 0


def test_decode_attention_rejects_heads_that_do_not_group(kernels):
    cache = torch.randn(2, 4, 16, 3, 64)
    q = torch.randn(1, 8, 64)  # 8 query heads over 3 KV heads
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        kernels.paged_decode_attention(
            torch.empty_like(q), q, cache[0], cache[1], torch.tensor([[1]]), torch.tensor([5]), 0.125, 0
        )
