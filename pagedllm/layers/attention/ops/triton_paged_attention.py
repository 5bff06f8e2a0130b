"""Triton kernels for the paged KV cache: write new K/V through the slot mapping, and attend.

Written for CUDA; they also run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
which must be set before this module is imported: ``triton.jit`` decides at decoration time).

Cache layout (one layer): ``kv_cache[0]`` / ``kv_cache[1]`` are ``[num_blocks, block_size, KVH, D]``.

``paged_attention`` serves a whole mixed batch (prefill chunks on a cached prefix and decodes) in one
launch. Grid: (num_tokens // BLOCK_Q + num_seqs, KVH). A program owns up to BLOCK_Q query tokens of one
request and all QPK query heads that share its KV head: BLOCK_M = BLOCK_Q * QPK rows (row m = token
m // QPK, head m % QPK), so each K/V tile is read once for the whole group. It finds its request by a
binary search over ``query_start_loc`` (request i's programs start at query_start_loc[i] // BLOCK_Q + i,
so the grid depends only on the token and request counts; spare programs exit at once). It walks the
request's keys TILE_N at a time through the block table, from the sliding-window start to the last
key its newest query may see, with an online softmax in fp32. Query at position p sees key k iff
k <= p (and k > p - window with a sliding window).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when these kernels, and Triton's own library (tl.max, tl.sum), were decorated for the CPU
    interpreter: TRITON_INTERPRET=1 must be set before triton itself is first imported."""
    return all(type(fn).__name__ == "InterpretedFunction" for fn in (_paged_attention_kernel, tl.max, tl.sum))


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cblk,
    stride_cslot,
    stride_chead,
    block_size,
    num_kv_heads,
    head_dim,
    KVH_P2: tl.constexpr,
    D_P2: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, KVH_P2)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    row = t.to(tl.int64)
    key = tl.load(k_ptr + row * stride_kt + h * stride_kh + d, mask=mask)
    value = tl.load(v_ptr + row * stride_vt + h * stride_vh + d, mask=mask)
    dst = blk * stride_cblk + off * stride_cslot + h * stride_chead + d
    tl.store(key_cache_ptr + dst, key, mask=mask)
    tl.store(value_cache_ptr + dst, value, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [T, KVH, D] (last dim contiguous); caches: [num_blocks, block_size, KVH, D]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_cache(key_cache, value_cache)
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "K/V rows must be contiguous in the head dim"
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.shape[1],
        num_kv_heads,
        head_dim,
        KVH_P2=triton.next_power_of_2(num_kv_heads),
        D_P2=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    num_seqs,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cblk,
    stride_cslot,
    stride_chead,
    stride_bt,
    head_dim,
    QPK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    D_P2: tl.constexpr,
    SLIDING: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Binary search: the last request whose first program (query_start_loc[i] // BLOCK_Q + i) is <= q_block.
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            left = mid + 1
        else:
            right = mid
    seq = left - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first token (within the request) of this program
    if first >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_P2)
    offs_n = tl.arange(0, TILE_N)
    tok = first + offs_m // QPK
    head = kv_head * QPK + offs_m % QPK
    row_ok = (offs_m // QPK < BLOCK_Q) & (tok < q_len)
    d_ok = offs_d < head_dim
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + tok

    kv_end = context_len + tl.minimum(first + BLOCK_Q, q_len)  # one past the newest query's position
    kv_begin = 0
    if SLIDING:
        kv_begin = tl.maximum(context_len + first - window + 1, 0) // TILE_N * TILE_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D_P2], 0.0, tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 below
    # A tl.tensor when compiled; mypy types it from the Python literal `left = 0`.
    table = block_table_ptr + seq.to(tl.int64) * stride_bt  # type: ignore[attr-defined]
    cache_head = kv_head.to(tl.int64) * stride_chead
    for start in range(kv_begin, kv_end, TILE_N):
        pos = start + offs_n
        in_seq = pos < kv_end
        blk = tl.load(table + pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        base = blk * stride_cblk + (pos % BLOCK_SIZE) * stride_cslot + cache_head
        k = tl.load(
            key_cache_ptr + base[None, :] + offs_d[:, None], mask=in_seq[None, :] & d_ok[:, None], other=0.0
        )  # [D, TILE_N]
        v = tl.load(
            value_cache_ptr + base[:, None] + offs_d[None, :], mask=in_seq[:, None] & d_ok[None, :], other=0.0
        )  # [TILE_N, D]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        visible = in_seq[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with nothing visible yet
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if IEEE:
            acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_i[:, None]
    out_rows = rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + out_rows, result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def attention_tiles(num_queries_per_kv: int, max_query_len: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N) for a step: small row tiles for decode-only steps, larger otherwise."""
    min_rows = 16 if max_query_len <= 1 else 64
    block_m = max(min_rows, triton.next_power_of_2(num_queries_per_kv))
    tile_n = 32 if head_dim <= 128 else 16
    return block_m, max(1, block_m // num_queries_per_kv), tile_n


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_tokens: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    tiles: tuple[int, int, int] | None = None,
) -> None:
    """out/q: [T, H, D]; caches [num_blocks, block_size, KVH, D]; block_table [B, W] int32;
    seq_lens [B] and query_start_loc [B+1] int32 (seq_len = cached context + this step's tokens)."""
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    _check_cache(key_cache, value_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    qpk = num_heads // num_kv_heads
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and head_dim >= 16
    block_m, block_q, tile_n = tiles or attention_tiles(qpk, max_query_len, head_dim)
    d_p2 = triton.next_power_of_2(head_dim)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        q,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        float(scale),
        num_seqs,
        int(sliding_window or 0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        head_dim,
        QPK=qpk,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        D_P2=d_p2,
        SLIDING=bool(sliding_window),
        IEEE=q.dtype == torch.float32,
        # The interpreter multiplies bf16 as raw uint16 bits in tl.dot: compute in fp32 there.
        UPCAST=interpreting() and q.dtype == torch.bfloat16,
        num_warps=8 if head_dim >= 256 or block_m >= 128 else 4,
    )


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1, (
        "key and value caches must share a layout with a contiguous head dim"
    )
