"""The C++ LoRA delta (``lora_add_``) against the torch path and a per-token reference, on every
ISA level this CPU runs."""

from __future__ import annotations

import pytest
import torch

from pagedllm.lora.layers import LoRASlots, make_step


def _slots(in_size: int, outs: list[int], kernel=None, dtype: torch.dtype = torch.float32) -> LoRASlots:
    slots = LoRASlots(in_size, outs, max_loras=3, max_rank=8, dtype=dtype, device=torch.device("cpu"))
    slots.kernel = kernel
    gen = torch.Generator().manual_seed(0)
    for slot, rank in enumerate([8, 4, 1]):
        weights = {
            i: (torch.randn(rank, in_size, generator=gen).to(dtype), torch.randn(o, rank, generator=gen).to(dtype))
            for i, o in enumerate(outs)
        }
        if slot == 1:
            weights.pop(0)  # a projection this adapter does not target
        slots.set_slot(slot, weights)
    return slots


def _reference(slots: LoRASlots, x: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
    """Per token: its slot's A then B, projection by projection (the definition)."""
    rows = []
    width = slots.max_loras * slots.max_rank
    for t, s in enumerate(token_slots):
        parts = []
        for i, b in enumerate(slots.b):
            a = slots.a[i * width + s * slots.max_rank : i * width + (s + 1) * slots.max_rank].float()
            bs = b[s * slots.max_rank : (s + 1) * slots.max_rank].float()
            parts.append((x[t] @ a.t()) @ bs if s >= 0 else torch.zeros(b.shape[1]))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


@pytest.mark.parametrize("outs", [[40, 24, 24], [72], [33, 33]])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_lora_add_matches_torch_and_reference(isa_ops, outs, tokens):
    in_size = 37  # not a multiple of any vector width: the tails run too
    token_slots = [(t % 4) - 1 for t in range(tokens)]  # base, slot 0, 1, 2, ...
    x = torch.randn(tokens, in_size)
    y0 = torch.randn(tokens, sum(outs))
    step = make_step(torch.tensor(token_slots), 3, 8, torch.float32)
    want = y0 + _reference(_slots(in_size, outs), x, token_slots)
    torch_path = _slots(in_size, outs).add_delta(x, y0.clone(), step)
    kernel_path = _slots(in_size, outs, isa_ops.lora_add_).add_delta(x, y0.clone(), step)
    torch.testing.assert_close(torch_path, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernel_path, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("outs", [[40, 24, 24], [33, 33]])
def test_lora_add_with_bfloat16_slots_widens_exactly(isa_ops, outs):
    """--lora-dtype bfloat16: the kernel widens A and B to float32 as they load, so it matches the
    float32 sums of the same (bfloat16-rounded) weights; the torch fallback computes in bfloat16."""
    in_size, tokens = 37, 23
    token_slots = [(t % 4) - 1 for t in range(tokens)]
    x, y0 = torch.randn(tokens, in_size), torch.randn(tokens, sum(outs))
    ref_slots = _slots(in_size, outs, dtype=torch.bfloat16)
    want = y0 + _reference(ref_slots, x, token_slots)
    kernel_path = _slots(in_size, outs, isa_ops.lora_add_, torch.bfloat16).add_delta(
        x, y0.clone(), make_step(torch.tensor(token_slots), 3, 8, torch.bfloat16)
    )
    torch.testing.assert_close(kernel_path, want, rtol=1e-5, atol=1e-4)
    torch_path = ref_slots.add_delta(x, y0.clone(), make_step(torch.tensor(token_slots), 3, 8, torch.bfloat16))
    torch.testing.assert_close(torch_path, want, rtol=2e-2, atol=0.5)
