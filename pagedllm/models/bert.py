"""BERT, RoBERTa and XLM-RoBERTa encoders (HF ``BertModel`` / ``RobertaModel`` / ``XLMRobertaModel``):
the body of embedding models such as all-MiniLM-L6-v2, bge and e5.

A post-norm encoder: embeddings = LayerNorm(word + learned absolute position + token type 0);
then per layer x = LayerNorm(x + Attention(x)); x = LayerNorm(x + down(act(up(x)))), with a bias
on every linear. Attention is bidirectional within each sequence and keeps no KV cache
(``layers/attention/encoder.py``); every sequence arrives whole in one step. ``forward`` returns
the final hidden states (HF's ``last_hidden_state`` rows, concatenated); pooling is the runner's.

RoBERTa and XLM-R differ only in their config (positions start at ``pad_token_id + 1``, one
token type), which ``hf_config`` normalises into ``position_offset`` / ``type_vocab_size``; so
one class serves all three. The module tree mirrors Hugging Face's (``encoder.layer.N.attention
.self...``) so checkpoint names map one to one, except q/k/v, which are fused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.attention.encoder import EncoderAttention
from pagedllm.layers.attention.metadata import CommonAttentionMetadata
from pagedllm.layers.embedding import VocabParallelEmbedding
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_arch import ModelArchConfig
from pagedllm.models.weight_utils import load_packed_weights

# Checkpoint name prefixes of the body inside HF's task models (BertForMaskedLM, RobertaFor...).
_BODY_PREFIXES = ("bert.", "roberta.")
# Parts we never run: the [CLS] pooler (pooling is the runner's), MLM / NSP heads.
_UNUSED_PREFIXES = ("pooler.", "cls.", "lm_head.")
# Index buffers some exporters save alongside the weights.
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


class BertEmbeddings(nn.Module):
    """LayerNorm(word + position + token-type-0 embeddings); positions are 0-based per sequence."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.position_offset = config.position_offset
        # RoBERTa numbers positions past its padding id and gives pad tokens that id (below).
        self.padding_idx = config.pad_token_id if config.position_offset else None
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden)
        # The table includes the rows before the offset (RoBERTa: 514 rows, 512 usable).
        self.position_embeddings = nn.Embedding(config.max_position_embeddings + config.position_offset, hidden)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Every token is type 0: the single-segment input that embedding models take.
        x = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        if self.padding_idx is not None:
            positions = _skip_padding(input_ids, positions, self.padding_idx)
        return self.LayerNorm(x + self.position_embeddings(positions + self.position_offset))


def _skip_padding(input_ids: torch.Tensor, positions: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """HF RoBERTa's position ids, minus the offset: a pad token inside a sequence sits at
    ``padding_idx - offset`` (= -1) and does not advance the count for the tokens after it.
    Without pad tokens this is ``positions`` unchanged (computed anyway: checking would sync the device)."""
    real = input_ids != padding_idx
    counted = real.cumsum(0)
    start = torch.arange(len(positions), device=positions.device) - positions  # each token's sequence start
    before = counted[start] - real[start].long()  # real tokens ahead of the sequence
    return torch.where(real, counted - before - 1, -1)


class BertSelfAttention(nn.Module):
    """q, k, v from one fused biased projection, then bidirectional attention per sequence."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        heads, head_dim = config.num_attention_heads, config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, heads, bias=True)
        self.q_size = self.qkv_proj.num_heads * head_dim  # this rank's heads
        self.attn = EncoderAttention(self.qkv_proj.num_heads, head_dim, scale=head_dim**-0.5)

    def forward(self, hidden_states: torch.Tensor, attn_metadata: CommonAttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size] * 3, dim=-1)
        return self.attn(q, k, v, attn_metadata)


class BertAddNorm(nn.Module):
    """LayerNorm(residual + dense(x)): HF's ``BertSelfOutput`` and ``BertOutput`` (post-norm)."""

    def __init__(self, input_size: int, config: ModelArchConfig) -> None:
        super().__init__()
        self.dense = RowParallelLinear(input_size, config.hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)  # HF's name, so checkpoint names match
        self.output = BertAddNorm(config.q_size, config)

    def forward(self, hidden_states: torch.Tensor, attn_metadata: CommonAttentionMetadata) -> torch.Tensor:
        return self.output(self.self(hidden_states, attn_metadata), hidden_states)


class BertIntermediate(nn.Module):
    """act(dense(x)): the MLP's up projection (not gated)."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.act_fn = get_act_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_fn(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertAddNorm(config.intermediate_size, config)

    def forward(self, hidden_states: torch.Tensor, attn_metadata: CommonAttentionMetadata) -> torch.Tensor:
        hidden_states = self.attention(hidden_states, attn_metadata)
        return self.output(self.intermediate(hidden_states), hidden_states)


class BertEncoder(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden_states: torch.Tensor, attn_metadata: CommonAttentionMetadata) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = cast(BertLayer, layer)(hidden_states, attn_metadata)
        return hidden_states


class BertModel(nn.Module):
    """The runner's entry point for BERT-family encoders: ``forward`` -> final hidden states.

    It has no LM head (no ``compute_logits``) and no paged ``Attention`` layer, so the runner
    binds no KV cache to it.
    """

    packed_modules_mapping = {"qkv_proj": ["query", "key", "value"]}

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: CommonAttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64, positions 0..n-1 within each whole sequence;
        ``attn_metadata.query_start_loc_cpu`` marks the sequences -> hidden states [T, hidden_size]."""
        return self.encoder(self.embeddings(input_ids, positions), attn_metadata)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our name for a checkpoint tensor, or None for the parts we do not run (pooler, heads)."""
        for prefix in _BODY_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if name.startswith(_UNUSED_PREFIXES) or name in _BUFFERS:
            return None
        # TF-era checkpoints call LayerNorm's parameters gamma and beta.
        return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors; returns our parameter names that were fully loaded."""
        return load_packed_weights(self, weights)
