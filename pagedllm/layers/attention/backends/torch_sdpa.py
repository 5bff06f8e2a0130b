"""Reference attention backend on torch's scaled_dot_product_attention (CPU and any device).

Decodes and other short queries (speculative verification) are batched one row per query
token: on CPU a C++ kernel reads K/V straight from the paged blocks
(``csrc/cpu_paged_attention.cpp``); elsewhere, or without the kernel, one SDPA call runs over K/V
gathered from the cache. Longer prefill chunks (possibly on top of a cached prefix) run one call
each: on CPU with float32 queries, a head size that is a multiple of 16 and up to 1536 positions, a
C++ kernel that reads the paged cache in place (``csrc/cpu_prefill_attention.cpp``: 1.4-1.6x
torch's flash SDPA plus its gather at 512 tokens); otherwise SDPA over K/V gathered from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.layers.attention.backends.base import AttentionBackend, write_kv
from pagedllm.layers.attention.metadata import CommonAttentionMetadata
from pagedllm.layers.cpu_kernels import cpu_ops
from pagedllm.layers.custom_op import CustomOp


@dataclass
class PrefillSeq:
    """One request with more than one query token this step."""

    start: int  # first row in the flat batch
    end: int
    context_len: int  # tokens already in the cache before this chunk
    kv_slots: torch.Tensor  # [context_len + query_len] cache slots
    block_table: torch.Tensor  # [max_blocks] int64: its row of the block table (the CPU kernel)


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None  # [Bd] rows of single-token queries
    decode_slots: torch.Tensor | None  # [Bd, Lmax] cache slots, padded (gather path only)
    decode_seq_lens: torch.Tensor | None  # [Bd]
    decode_table: torch.Tensor | None  # [Bd, max_blocks] (kernel path)
    prefills: list[PrefillSeq]
    num_tokens: int
    all_rowwise: bool = False  # every token is a row-wise query, in batch order: no gather/scatter
    _masks: dict = field(default_factory=dict)  # per sliding window, built on first use

    def decode_mask(self, window: int | None) -> torch.Tensor:
        key = ("decode", window)
        if key not in self._masks:
            seq_lens, slots = self.decode_seq_lens, self.decode_slots
            assert seq_lens is not None and slots is not None, "the gather path's decode metadata"
            self._masks[key] = _decode_mask(seq_lens, slots.shape[1], window)
        return self._masks[key]

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor | None:
        seq = self.prefills[index]
        if seq.context_len == 0 and window is None:
            return None  # plain causal: SDPA's is_causal path
        key = (index, window)
        if key not in self._masks:
            self._masks[key] = _prefill_mask(seq.end - seq.start, seq.context_len, window, seq.kv_slots.device)
        return self._masks[key]


def _decode_mask(seq_lens: torch.Tensor, max_len: int, window: int | None) -> torch.Tensor:
    pos = torch.arange(max_len, device=seq_lens.device)
    mask = pos[None, :] < seq_lens[:, None]
    if window is not None:
        mask &= pos[None, :] >= (seq_lens[:, None] - window)
    return mask[:, None, None, :]  # [Bd, 1, 1, L]


def _prefill_mask(query_len: int, context_len: int, window: int | None, device) -> torch.Tensor:
    q_pos = torch.arange(query_len, device=device)[:, None] + context_len
    k_pos = torch.arange(context_len + query_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _rowwise_queries(
    idx: list[int], query_lens: list[int], loc: list[int], seq_lens: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split short queries into one decode-style row per token: (flat row, tokens it attends
    to, owning request). Every query token's K/V is written before attention runs, so token j of
    a request attends to its context plus tokens 0..j, exactly the causal mask."""
    counts = np.asarray([query_lens[i] for i in idx], dtype=np.int64)
    owners = np.repeat(np.asarray(idx, dtype=np.int64), counts)
    offset = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    rows = np.asarray(loc, dtype=np.int64)[owners] + offset
    lens = np.asarray(seq_lens, dtype=np.int64)[owners] - np.repeat(counts, counts) + 1 + offset
    return rows, lens, owners


def _slots_for(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0..length-1 for each row of ``block_table``."""
    pos = torch.arange(length, device=block_table.device)
    return block_table[:, pos // block_size] * block_size + pos % block_size


class KVCacheWrite(CustomOp):
    """``forward(kv_cache, k, v, slot_mapping)``: scatter new K/V rows into the paged cache; on CPU
    with float32 K/V one C++ call instead of ~8 ops (rows are [T, KVH * D] views of the fused qkv
    output), into a float32 cache or a 16-bit one (--kv-cache-dtype)."""

    def dispatch_key(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return args[1]  # the new keys' dtype: the kernel takes float32 K/V into any cache dtype

    def forward_native(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        write_kv(kv_cache, k, v, slot_mapping)

    def forward_cpu(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.cpu_ops.write_kv_cache(k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1), kv_cache, slot_mapping)


_UNRESOLVED = object()

# With the CPU kernel, queries up to this long (decodes, speculative verification, short chunks)
# run row by row on the paged decode path; longer ones as one SDPA call each over a gathered K/V.
MAX_ROWWISE_QUERY_LEN = 17
# The CPU prefill kernel takes head sizes that are whole vectors on every ISA level (AVX-512's 16
# lanes) and sequences up to PREFILL_KERNEL_MAX_LEN positions; other sizes, longer sequences and
# 16-bit queries take SDPA. Measured at SmolLM's shapes (9 / 3 heads of 64; Sapphire Rapids-class
# Xeon, avx512 build, 2 threads): the kernel against gather + SDPA 1.6-2.1x at 128 tokens, 1.4-1.6x
# at 512, 1.1-1.2x at 1024, 0.85-0.89x at 2048 (it stays near 125 GFLOP/s while SDPA's blocks
# grow; docs/benchmarks.md).
PREFILL_KERNEL_DIM_MULTIPLE = 16
PREFILL_KERNEL_MAX_LEN = 1536


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, use_cpu_kernels: bool = True) -> None:
        self.use_cpu_kernels = use_cpu_kernels
        # One backend serves one model's caches (one dtype): the write picks its path on the first.
        self.write_kv = KVCacheWrite() if use_cpu_kernels else KVCacheWrite().force_native()
        self._cpu_ops: Any = _UNRESOLVED  # torch.ops.pagedllm_<isa> or None, resolved on first use

    def _kernels(self, device: torch.device) -> Any:
        """The CPU kernels for tensors on ``device`` (None: the SDPA paths). Resolved once: this
        runs for every layer of every step, and resolving reads the environment."""
        if not self.use_cpu_kernels or device.type != "cpu":
            return None
        if self._cpu_ops is _UNRESOLVED:
            self._cpu_ops = cpu_ops()
        return self._cpu_ops

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        query_lens = common.query_lens_cpu()
        device = common.block_table.device
        # The gather fallback copies K/V per row: keep it to true decodes (one row per request).
        kernels = self._kernels(device) is not None
        rowwise = MAX_ROWWISE_QUERY_LEN if kernels else 1
        short_idx = [i for i, n in enumerate(query_lens) if n <= rowwise]
        prefill_idx = [i for i, n in enumerate(query_lens) if n > rowwise]
        loc, seq_lens = common.query_start_loc_cpu, common.seq_lens_cpu
        decode_rows = decode_slots = decode_lens = decode_table = None
        if short_idx and common.max_query_len == 1 and kernels:
            # Pure decode (one token per request, the kernel path): row i is request i, attending
            # to its whole sequence through its own table (what _rowwise_queries gives, without
            # its index arithmetic: ~50 us of a batch-1 step on cold caches).
            decode_rows = torch.arange(len(query_lens), device=device)
            decode_lens = common.seq_lens
            decode_table = common.block_table.contiguous()
        elif short_idx:
            rows, lens, owners = _rowwise_queries(short_idx, query_lens, loc, seq_lens)
            decode_rows = torch.from_numpy(rows).to(device)
            decode_lens = torch.from_numpy(lens).to(device)
            table = common.block_table[torch.from_numpy(owners).to(device)]
            if kernels:
                decode_table = table.contiguous()
            else:
                decode_slots = _slots_for(table, int(lens.max()), common.block_size)
        prefills = [
            PrefillSeq(
                loc[i],
                loc[i + 1],
                seq_lens[i] - query_lens[i],
                _slots_for(common.block_table[i : i + 1], seq_lens[i], common.block_size)[0],
                common.block_table[i],
            )
            for i in prefill_idx
        ]
        return TorchAttentionMetadata(
            common.slot_mapping,
            decode_rows,
            decode_slots,
            decode_lens,
            decode_table,
            prefills,
            common.num_actual_tokens,
            all_rowwise=not prefills,
        )

    def forward(self, layer, q, k, v, metadata: TorchAttentionMetadata) -> torch.Tensor:
        self.write_kv(layer.kv_cache, k, v, metadata.slot_mapping)
        num_heads, num_kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q = q.view(-1, num_heads, head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even when q is a strided view
        if metadata.decode_table is not None:
            self._decode_kernel(layer, q, out, metadata)
            if metadata.all_rowwise:
                return out.view(-1, num_heads * head_dim)
        key_cache = layer.key_cache.view(-1, num_kv_heads, head_dim)
        value_cache = layer.value_cache.view(-1, num_kv_heads, head_dim)
        if metadata.decode_table is None and metadata.decode_rows is not None:
            self._decode(layer, q, out, key_cache, value_cache, metadata)
        kernels = self._kernels(q.device) if metadata.prefills else None
        prefill_kernel = (
            kernels.paged_prefill_attention
            if kernels is not None and q.dtype == torch.float32 and head_dim % PREFILL_KERNEL_DIM_MULTIPLE == 0
            else None
        )
        for i, seq in enumerate(metadata.prefills):
            if prefill_kernel is not None and seq.context_len + seq.end - seq.start <= PREFILL_KERNEL_MAX_LEN:
                prefill_kernel(
                    out[seq.start : seq.end],
                    q[seq.start : seq.end],
                    layer.key_cache,
                    layer.value_cache,
                    seq.block_table,
                    seq.context_len,
                    layer.scale,
                    layer.sliding_window or 0,
                )
                continue
            # [KVH, L, D], widened to the query's dtype under a 16-bit cache (--kv-cache-dtype)
            keys = key_cache[seq.kv_slots].transpose(0, 1).to(q.dtype)
            values = value_cache[seq.kv_slots].transpose(0, 1).to(q.dtype)
            query = q[seq.start : seq.end].transpose(0, 1)  # [H, Lq, D]
            mask = metadata.prefill_mask(i, layer.sliding_window)
            # 4-D (a batch of one): torch's CPU flash kernel takes only 4-D inputs; 3-D ones fall
            # back to the math path, ~3.5x slower for a 512-token prompt.
            res = F.scaled_dot_product_attention(
                query[None],
                keys[None],
                values[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=layer.scale,
                enable_gqa=num_heads != num_kv_heads,
            )
            out[seq.start : seq.end] = res[0].transpose(0, 1)
        return out.view(-1, num_heads * head_dim)

    def _decode_kernel(self, layer, q, out, metadata: TorchAttentionMetadata) -> None:
        kernel = self._kernels(q.device).paged_decode_attention
        args = (
            layer.key_cache,
            layer.value_cache,
            metadata.decode_table,
            metadata.decode_seq_lens,
            layer.scale,
            layer.sliding_window or 0,
        )
        if metadata.all_rowwise:  # the kernel reads the strided q view and writes out directly
            kernel(out, q, *args)
            return
        rows = metadata.decode_rows
        assert rows is not None, "set whenever the batch has decode rows"
        result = torch.empty((rows.shape[0], *q.shape[1:]), dtype=q.dtype, device=q.device)
        kernel(result, q[rows], *args)
        out[rows] = result

    @staticmethod
    def _decode(layer, q, out, key_cache, value_cache, metadata: TorchAttentionMetadata) -> None:
        rows = metadata.decode_rows
        keys = key_cache[metadata.decode_slots].transpose(1, 2).to(q.dtype)  # [Bd, KVH, L, D]
        values = value_cache[metadata.decode_slots].transpose(1, 2).to(q.dtype)
        query = q[rows].unsqueeze(2)  # [Bd, H, 1, D]
        res = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=metadata.decode_mask(layer.sliding_window),
            scale=layer.scale,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        out[rows] = res.squeeze(2)
