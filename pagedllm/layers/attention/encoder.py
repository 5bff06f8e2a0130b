"""Bidirectional attention for encoder models (BERT family): no KV cache, no causal mask.

Every sequence of the flat variable-length batch arrives whole in one step, so each token
attends to all tokens of its own sequence and to nothing else. There is no paged cache: an
encoder model holds :class:`EncoderAttention`, never the paged ``Attention`` layer, so the
model runner binds no KV cache to it and the KV pool can be empty.

Why one ``scaled_dot_product_attention`` call per sequence rather than one call over the whole
batch: any mask (block-diagonal over the flat batch, or key padding over a padded [B, L] batch)
sends torch's CPU SDPA off its flash kernel onto the math path, and the block-diagonal call
also computes all T x T scores per head. Measured on this project's 2-core CPU box (12 heads of
32, MiniLM's shape): 32 sequences of 16-128 tokens took 51 ms one call per sequence, 563 ms
block-diagonal and 362 ms padded (copies included); 64 sequences of 4-24 tokens 3.5 / 24 / 4.7 ms; three of
200/40/7 tokens 0.75 / 1.5 / 2.2 ms. The inputs must be 4-D ([1, H, L, D] views): 3-D inputs
also miss the flash kernel (7 tokens: 4.6 ms vs 0.03 ms). When every sequence has the same
length the batch is one call over [B, H, L, D] views, with no copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention.metadata import CommonAttentionMetadata


class EncoderAttention(nn.Module):
    """softmax(q k^T * scale) v within each sequence; q: [T, H*D], k, v: [T, KVH*D] -> [T, H*D]."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: CommonAttentionMetadata
    ) -> torch.Tensor:
        """``attn_metadata.query_start_loc_cpu``: request i owns tokens [loc[i], loc[i+1])."""
        tokens, loc = q.shape[0], attn_metadata.query_start_loc_cpu
        if loc[-1] != tokens:
            raise ValueError(f"attention metadata covers {loc[-1]} tokens but the batch has {tokens}")
        if tokens == 0:
            return q
        q, k, v = (x.view(tokens, -1, self.head_dim) for x in (q, k, v))
        lengths = {end - start for start, end in zip(loc[:-1], loc[1:])}
        if len(lengths) == 1:
            out = self._equal_lengths(q, k, v, lengths.pop())
        else:
            out = torch.cat([self._one_sequence(q[s:e], k[s:e], v[s:e]) for s, e in zip(loc[:-1], loc[1:])])
        return out.reshape(tokens, -1)

    def _equal_lengths(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
        """Every sequence ``length`` tokens: one batched call over [B, H, L, D] views."""
        batch = q.shape[0] // length
        q, k, v = (x.view(batch, length, -1, self.head_dim).transpose(1, 2) for x in (q, k, v))
        return self._sdpa(q, k, v).transpose(1, 2)

    def _one_sequence(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[L, H, D] -> [L, H, D] for one sequence, as a batch of one (see the module docstring)."""
        return self._sdpa(q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2))[0].transpose(0, 1)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gqa = self.num_kv_heads != self.num_heads
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=gqa)
