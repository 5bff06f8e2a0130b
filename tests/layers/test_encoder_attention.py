"""EncoderAttention: bidirectional attention within each sequence of a flat batch, no KV cache,
against one masked softmax over the whole batch."""

import math

import pytest
import torch

from pagedllm.layers.attention.encoder import EncoderAttention
from pagedllm.layers.attention.metadata import build_common_metadata

HEAD_DIM = 8


def metadata(lengths):
    """Whole sequences from position 0; the block tables are unused (no cache)."""
    return build_common_metadata(list(lengths), [0] * len(lengths), [[0] * max(n, 1) for n in lengths], 1)


def reference(q, k, v, lengths, heads, kv_heads, scale):
    """softmax(q k^T * scale) v with a block-diagonal mask: token i sees token j iff same sequence."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    q = q.view(len(seq), heads, HEAD_DIM).transpose(0, 1)
    k = k.view(len(seq), kv_heads, HEAD_DIM).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    v = v.view(len(seq), kv_heads, HEAD_DIM).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    scores = (q @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(seq[:, None] != seq[None, :], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(len(seq), -1)


@pytest.mark.parametrize("lengths", [[5, 1, 12, 3], [7, 7, 7], [1], [16]])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_matches_block_diagonal_reference(lengths, heads, kv_heads):
    gen = torch.Generator().manual_seed(len(lengths) + heads + kv_heads)
    tokens, scale = sum(lengths), 1 / math.sqrt(HEAD_DIM)
    q = torch.randn(tokens, heads * HEAD_DIM, generator=gen)
    k, v = (torch.randn(tokens, kv_heads * HEAD_DIM, generator=gen) for _ in range(2))
    layer = EncoderAttention(heads, HEAD_DIM, scale, num_kv_heads=kv_heads)
    out = layer(q, k, v, metadata(lengths))
    assert out.shape == (tokens, heads * HEAD_DIM)
    torch.testing.assert_close(out, reference(q, k, v, lengths, heads, kv_heads, scale), atol=1e-5, rtol=1e-5)


def test_sequences_do_not_see_each_other():
    """Changing one sequence's tokens leaves the other sequences' outputs bitwise unchanged."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, 2 * HEAD_DIM, generator=gen) for _ in range(3))
    layer, md = EncoderAttention(2, HEAD_DIM, 0.3), metadata([4, 6])
    before = layer(q, k, v, md)
    k2, v2 = k.clone(), v.clone()
    k2[4:], v2[4:] = 0.0, 7.0
    after = layer(q, k2, v2, md)
    assert torch.equal(after[:4], before[:4]) and not torch.equal(after[4:], before[4:])


def test_empty_batch():
    empty = torch.zeros(0, 2 * HEAD_DIM)
    assert EncoderAttention(2, HEAD_DIM, 0.3)(empty, empty, empty, metadata([])).shape == (0, 2 * HEAD_DIM)


def test_metadata_must_cover_the_batch():
    x = torch.zeros(5, 2 * HEAD_DIM)
    with pytest.raises(ValueError, match="attention metadata covers 4 tokens but the batch has 5"):
        EncoderAttention(2, HEAD_DIM, 0.3)(x, x, x, metadata([4]))


def test_heads_must_group():
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        EncoderAttention(4, HEAD_DIM, 0.3, num_kv_heads=3)
