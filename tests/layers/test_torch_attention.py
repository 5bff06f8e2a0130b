"""The torch paged-attention backend against plain dense attention."""

import math

import pytest
import torch

from pagedllm.layers.attention import Attention
from pagedllm.layers.attention.backends.torch_sdpa import MAX_ROWWISE_QUERY_LEN, TorchAttentionBackend
from pagedllm.layers.attention.metadata import build_common_metadata
from pagedllm.layers.cpu_kernels import cpu_ops

BLOCK = 4


def dense_attention(q, k, v, num_kv_heads, window=None):
    """q: [L, H, D], k/v: [L, KVH, D] for the whole sequence, causal."""
    length, heads, dim = q.shape
    k = k.repeat_interleave(heads // num_kv_heads, dim=1)
    v = v.repeat_interleave(heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
    pos = torch.arange(length)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["cpu-kernel", "gather"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dim", [8, 16])  # 16: the long chunk on the CPU prefill kernel (8 takes SDPA)
def test_mixed_batch_matches_dense(window, use_kernels, dim):
    torch.manual_seed(0)
    heads, kv_heads, num_blocks = 4, 2, 32
    layer = Attention(heads, dim, kv_heads, 1 / math.sqrt(dim), sliding_window=window)
    backend = TorchAttentionBackend(use_cpu_kernels=use_kernels)
    if use_kernels and cpu_ops() is None:
        pytest.skip("the C++ kernels could not be built here")
    layer.bind_kv_cache(torch.zeros(2, num_blocks, BLOCK, kv_heads, dim), backend)
    # (context, new tokens): a short prefill from scratch, a short chunk on a cached prefix (both
    # row by row, as speculative verification runs), a decode, and a chunk long enough for SDPA.
    plan = [(0, 7), (6, 5), (9, 1), (3, MAX_ROWWISE_QUERY_LEN + 4)]
    tables = [[3, 1], [5, 2, 9], [4, 8, 7], [10, 11, 12, 13, 14, 15, 16]]
    full = [
        (torch.randn(c + n, heads, dim), torch.randn(c + n, kv_heads, dim), torch.randn(c + n, kv_heads, dim))
        for c, n in plan
    ]
    # Fill the cached prefixes first (as earlier steps would have).
    ctx_md = build_common_metadata(
        [c for c, _ in plan if c], [0 for c, _ in plan if c], [t for (c, _), t in zip(plan, tables) if c], BLOCK
    )
    ks = torch.cat([f[1][:c] for (c, _), f in zip(plan, full) if c]).flatten(1)
    vs = torch.cat([f[2][:c] for (c, _), f in zip(plan, full) if c]).flatten(1)
    qs = torch.cat([f[0][:c] for (c, _), f in zip(plan, full) if c]).flatten(1)
    layer(qs, ks, vs, backend.build_metadata(ctx_md))
    md = build_common_metadata([n for _, n in plan], [c for c, _ in plan], tables, BLOCK)
    q = torch.cat([f[0][c:] for (c, _), f in zip(plan, full)]).flatten(1)
    k = torch.cat([f[1][c:] for (c, _), f in zip(plan, full)]).flatten(1)
    v = torch.cat([f[2][c:] for (c, _), f in zip(plan, full)]).flatten(1)
    out = layer(q, k, v, backend.build_metadata(md)).view(-1, heads, dim)
    start = 0
    for (c, n), (fq, fk, fv) in zip(plan, full):
        expected = dense_attention(fq, fk, fv, kv_heads, window)[c:]
        torch.testing.assert_close(out[start : start + n], expected, atol=1e-5, rtol=1e-5)
        start += n
