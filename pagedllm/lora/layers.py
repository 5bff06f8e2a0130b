"""The device slots of one fused linear's LoRA adapters, and the per-step delta.

Each LoRA-wrapped linear (qkv, o, gate_up, down of every decoder layer) keeps ``max_loras`` slots
of rank ``max_lora_rank`` for each projection fused into it (q/k/v, gate/up): the A matrices of
all slots stacked as one ``[n * S * R, in]`` tensor (projection-major, then slot, then rank) and
per projection one ``B`` as ``[S * R, out_i]`` with the adapter's scale folded in. A smaller rank,
or a projection the adapter does not target, leaves zeros. A step adds to ``y = x W^T``, for each
token t running the adapter in slot s, ``y[t, proj_i] += B_i[s]^T (A_i[s] x[t])``:

- on CPU in float32, the C++ kernel ``lora_add_`` (``csrc/cpu_lora.cpp``): per token, its own
  slot's shrink and expand, base-model tokens skipped (one call per layer); on CUDA the Triton
  kernel of the same signature (``lora/triton_lora.py``, tested under Triton's interpreter);
- elsewhere, torch: ``((x A^T) * mask) B_i`` where ``mask[t, s * R + r]`` is 1 when token t runs
  slot s: one shrink GEMM for every slot, the other slots' columns zeroed, one expand GEMM per
  projection. No grouping or index copies, at S times the FLOPs of the tokens' own adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LoRAStep:
    """One step's mapping: each token's slot (-1: the base model) and the same as the torch
    path's ``[T, S * R]`` mask (model dtype)."""

    token_slots: torch.Tensor  # [T] int64
    mask: torch.Tensor


def make_step(token_slots: torch.Tensor, max_loras: int, max_rank: int, dtype: torch.dtype) -> LoRAStep:
    """The step's mapping for ``token_slots`` ([T] slot per token, -1: base)."""
    column_slot = torch.arange(max_loras, device=token_slots.device).repeat_interleave(max_rank)
    return LoRAStep(token_slots, (token_slots[:, None] == column_slot[None, :]).to(dtype))


class LoRASlots:
    """The adapters' A and B of one linear layer (plain tensors: not parameters, not in the
    model's state dict). ``output_sizes``: the fused projections' output sizes, in shard order.
    ``kernel``: a ``lora_add_`` (``manager.delta_kernel``: C++ on CPU for float32 activations with
    float32 or bfloat16 slots, Triton on CUDA), else None. ``dtype``: the slots' (``--lora-dtype``)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        kernel: Callable[..., Any] | None = None,
    ) -> None:
        self.max_loras, self.max_rank, self.kernel = max_loras, max_rank, kernel
        width = max_loras * max_rank
        self.a = torch.zeros(len(output_sizes) * width, input_size, dtype=dtype, device=device)
        self.b = [torch.zeros(width, size, dtype=dtype, device=device) for size in output_sizes]
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes) + 1)]

    def set_slot(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Load projection index -> (A [r, in], scale * B [out, r]) into ``slot``; the projections
        left out (and ranks below the maximum) get zeros."""
        for i, b in enumerate(self.b):
            a_rows = self._rows(i * self.max_loras + slot)
            b_rows = self._rows(slot)
            self.a[a_rows].zero_()
            b[b_rows].zero_()
            if i in weights:
                lora_a, lora_b = weights[i]
                rank = lora_a.shape[0]
                self.a[a_rows.start : a_rows.start + rank].copy_(lora_a)
                b[b_rows.start : b_rows.start + rank].copy_(lora_b.t())

    def _rows(self, block: int) -> slice:
        return slice(block * self.max_rank, (block + 1) * self.max_rank)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """``y`` (= x W^T, [T, out]) plus each token's adapter delta, in place."""
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if self.kernel is not None and x2.is_contiguous():
            self.kernel(y2, x2, self.a, self.b, step.token_slots, self.max_loras, self.max_rank)
            return y
        width = self.max_loras * self.max_rank
        shrunk = torch.mm(x2.to(self.a.dtype), self.a.t())
        shrunk.view(shrunk.shape[0], len(self.b), width).mul_(step.mask.unsqueeze(1))
        for i, b in enumerate(self.b):
            out, h = y2[:, self.offsets[i] : self.offsets[i + 1]], shrunk[:, i * width : (i + 1) * width]
            if b.dtype == out.dtype:
                out.addmm_(h, b)
            else:  # --lora-dtype other than the model's
                out.add_(torch.mm(h, b).to(out.dtype))
        return y
