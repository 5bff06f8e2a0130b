"""Token embedding and LM head, both split over the vocabulary across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import all_gather, all_reduce, get_tp_rank, get_tp_size
from pagedllm.layers.linear import ShardId, copy_checked, cpu_gemm_weight, linear


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows [r * n, (r + 1) * n); the last shard is zero-padded when the
    vocabulary does not divide evenly, so every rank has the same shape."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)  # ceil
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if loaded_weight.dim() != 2 or loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected "
                             f"({self.num_embeddings}, {param.shape[1]})")
        rows = loaded_weight[self.vocab_start:self.vocab_start + self.shard_size]
        param.data[len(rows):].zero_()
        copy_checked(param.data[:len(rows)], rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids owned by another rank look up row 0 and are zeroed; the all-reduce fills them in.
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.shard_size)
        out = F.embedding(torch.where(owned, local, 0), self.weight)
        return all_reduce(out * owned.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary. With tied embeddings the model assigns the
    embedding's parameter to ``self.weight`` (same shape and vocab split)."""

    def process_weights_after_loading(self) -> None:
        """The CPU GEMM layout of the linears (``cpu_gemm_weight``). A tied head gets its own
        copy: the embedding lookup needs the plain row-major table."""
        self.weight = cpu_gemm_weight(self.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = all_gather(linear(hidden_states, self.weight), dim=-1)
        return logits[..., :self.num_embeddings]  # drop the padding rows of the last shard
