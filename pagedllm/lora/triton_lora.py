"""The LoRA delta as a Triton kernel (CUDA), with the C++ op's signature (``csrc/cpu_lora.cpp``).

Written for CUDA; it also runs on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is imported), which is how it is tested without a GPU. One launch per
projection fused into the layer; grid (tokens, output blocks). A program loads its token's slot
(base tokens, slot -1, only mask their loads and store), shrinks ``h = A[slot] x`` over the input
in BLOCK_K chunks (fp32 accumulation) and adds ``h B[slot]`` to its block of ``y``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_kernel(
    y_ptr,
    x_ptr,
    a_ptr,
    b_ptr,
    slots_ptr,
    stride_y,
    stride_x,
    in_size,
    out_size,
    y_offset,
    a_first_row,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    # A base token's limits are 0: every load and the store are masked off.
    rank_limit = tl.where(valid, RANK, 0)
    in_limit = tl.where(valid, in_size, 0)
    out_limit = tl.where(valid, out_size, 0)
    r = tl.arange(0, RANK_PAD)
    r_ok = r < rank_limit
    h = tl.zeros([RANK_PAD], dtype=tl.float32)
    for k0 in range(0, in_size, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < in_limit
        a_rows = a_first_row + slot * RANK + r
        a = tl.load(a_ptr + a_rows[:, None] * in_size + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0)
        h += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < out_limit
    b_rows = slot * RANK + r
    b = tl.load(b_ptr + b_rows[:, None] * out_size + n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    delta = tl.sum(h[:, None] * b.to(tl.float32), axis=0)
    y_ptrs = y_ptr + t * stride_y + y_offset + n
    y = tl.load(y_ptrs, mask=n_ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=n_ok)


def lora_add_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: list[torch.Tensor],
    token_slots: torch.Tensor,
    max_loras: int,
    max_rank: int,
) -> None:
    """y [T, O] += each token's delta (see ``lora/layers.py`` for the layouts), in place."""
    tokens = x.shape[0]
    if tokens == 0:
        return
    offset = 0
    for i, b_i in enumerate(b):
        out_size = b_i.shape[1]
        block_n = min(128, triton.next_power_of_2(out_size))
        grid = (tokens, triton.cdiv(out_size, block_n))
        _lora_kernel[grid](
            y,
            x,
            a,
            b_i,
            token_slots,
            y.stride(0),
            x.stride(0),
            x.shape[1],
            out_size,
            offset,
            i * max_loras * max_rank,
            RANK=max_rank,
            RANK_PAD=triton.next_power_of_2(max_rank),
            BLOCK_K=64,
            BLOCK_N=block_n,
        )
        offset += out_size
