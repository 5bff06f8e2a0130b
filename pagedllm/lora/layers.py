"""The device slots of one fused linear's LoRA adapters, and the per-step delta.

Each LoRA-wrapped linear (qkv, o, gate_up, down of every decoder layer) keeps ``max_loras`` slots
of rank ``max_lora_rank`` for each projection fused into it (q/k/v, gate/up): the A matrices of
all slots stacked as one ``[n * S * R, in]`` tensor (projection-major, then slot, then rank) and
per projection one ``B`` as ``[out_i, S * R]`` with the adapter's scale folded in. A smaller rank,
or a projection the adapter does not target, leaves zeros. A step adds to ``y = x W^T``

    y[:, proj_i] += ((x A^T) * mask) [:, proj_i's columns] B_i^T

where ``mask[t, s * R + r]`` is 1 when token ``t`` runs the adapter in slot ``s`` (shrink for every
slot in one GEMM, zero the other slots' columns, expand per projection in one GEMM). Base-model
tokens have an all-zero mask row, so mixed batches need no grouping or index copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRAStep:
    """One step's mapping: ``mask`` [T, S * R] (model dtype), 1 where token t runs slot s."""

    mask: torch.Tensor


def step_mask(token_slots: torch.Tensor, max_loras: int, max_rank: int, dtype: torch.dtype) -> torch.Tensor:
    """[T] slot per token (-1: base) -> the [T, S * R] mask of ``LoRAStep``."""
    column_slot = torch.arange(max_loras, device=token_slots.device).repeat_interleave(max_rank)
    return (token_slots[:, None] == column_slot[None, :]).to(dtype)


class LoRASlots:
    """The adapters' A and B of one linear layer (plain tensors: not parameters, not in the
    model's state dict). ``output_sizes``: the fused projections' output sizes, in shard order."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        width = max_loras * max_rank
        self.a = torch.zeros(len(output_sizes) * width, input_size, dtype=dtype, device=device)
        self.b = [torch.zeros(size, width, dtype=dtype, device=device) for size in output_sizes]
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes) + 1)]

    def set_slot(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Load projection index -> (A [r, in], scale * B [out, r]) into ``slot``; the projections
        left out (and ranks below the maximum) get zeros."""
        rank_cols = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for i, b in enumerate(self.b):
            a_rows = self._a_rows(i, slot)
            self.a[a_rows].zero_()
            b[:, rank_cols].zero_()
            if i in weights:
                lora_a, lora_b = weights[i]
                rank = lora_a.shape[0]
                self.a[a_rows.start : a_rows.start + rank].copy_(lora_a)
                b[:, rank_cols.start : rank_cols.start + rank].copy_(lora_b)

    def _a_rows(self, projection: int, slot: int) -> slice:
        start = (projection * self.max_loras + slot) * self.max_rank
        return slice(start, start + self.max_rank)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """``y`` (= x W^T, [T, out]) plus each token's adapter delta, in place."""
        width = self.max_loras * self.max_rank
        shrunk = torch.mm(x.reshape(-1, x.shape[-1]), self.a.t())
        shrunk.view(shrunk.shape[0], len(self.b), width).mul_(step.mask.unsqueeze(1))
        out = y.view(-1, y.shape[-1])
        for i, b in enumerate(self.b):
            out[:, self.offsets[i] : self.offsets[i + 1]].addmm_(shrunk[:, i * width : (i + 1) * width], b.t())
        return y
