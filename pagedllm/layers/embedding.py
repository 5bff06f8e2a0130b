"""Token embedding and LM head, both split over the vocabulary across tensor-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.quantization import QuantizationConfig, current_quant_config
from pagedllm.layers.quantization.base import set_weight_attrs
from pagedllm.layers.sharding import ShardId, copy_checked


@dataclass(frozen=True)
class VocabShard:
    """Rank ``rank`` of ``size`` holds vocabulary rows [start, end) in a table of ``shard_size``
    rows: the vocabulary is padded to ``shard_size * size`` so every rank has the same shape,
    and the last shard's rows past the real vocabulary are zero."""

    start: int
    end: int
    shard_size: int

    @classmethod
    def of(cls, num_embeddings: int, rank: int, size: int) -> VocabShard:
        shard_size = -(-num_embeddings // size)  # ceil
        start = min(rank * shard_size, num_embeddings)
        return cls(start, min(start + shard_size, num_embeddings), shard_size)

    @property
    def num_real(self) -> int:
        return self.end - self.start


class VocabParallelEmbedding(nn.Module):
    """Token id -> embedding row; each rank owns a ``VocabShard`` of the table."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.shard = VocabShard.of(num_embeddings, self.tp.rank, self.tp.size)
        self.create_weight()

    def create_weight(self) -> None:
        """``weight`` [shard_size, embedding_dim]: this rank's rows of the table."""
        self.weight = nn.Parameter(torch.empty(self.shard.shard_size, self.embedding_dim), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy this rank's rows of the full [vocab, hidden] checkpoint table; zero the padding."""
        if loaded_weight.dim() != 2 or loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected "
                f"({self.num_embeddings}, {param.shape[1]})"
            )
        shard = self.shard
        param.data[shard.num_real :].zero_()
        copy_checked(param.data[: shard.num_real], loaded_weight[shard.start : shard.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids owned by another rank look up row 0 and are zeroed; the all-reduce fills them in.
        local = input_ids - self.shard.start
        owned = (local >= 0) & (local < self.shard.num_real)
        out = F.embedding(torch.where(owned, local, 0), self.weight)
        return self.tp.all_reduce(out * owned.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary: each rank computes its shard's logits with its
    ``quant_method`` (the format's LM-head method; float so far) and the shards are gathered."""

    def __init__(self, num_embeddings: int, embedding_dim: int, quant_config: QuantizationConfig | None = None) -> None:
        self.quant_method = (quant_config or current_quant_config()).get_lm_head_method()
        super().__init__(num_embeddings, embedding_dim)

    def create_weight(self) -> None:
        self.quant_method.create_weights(
            self, self.embedding_dim, [self.shard.shard_size], torch.get_default_dtype(), self.weight_loader
        )

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        """Share the embedding's table (same shape and vocabulary split). On CPU the method's
        processing then gives the head its own GEMM-layout copy: lookups need the plain table."""
        self.weight = embed_tokens.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(self.quant_method.apply(self, hidden_states), dim=-1)
        return logits[..., : self.num_embeddings]  # drop the padding rows of the last shard
