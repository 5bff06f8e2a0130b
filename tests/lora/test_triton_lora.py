"""The Triton LoRA kernel against the per-token reference: compiled on CUDA, in Triton's CPU
interpreter otherwise (TRITON_INTERPRET=1 set before triton is imported)."""

from __future__ import annotations

import pytest
import torch

from tests.layers.test_cpu_lora import _reference, _slots
from tests.triton_kernels import import_kernels

CUDA = torch.cuda.is_available()


def _kernel():
    return import_kernels("pagedllm.lora.triton_lora", CUDA).lora_add_


@pytest.mark.parametrize("outs", [[40, 24, 24], [72]])
@pytest.mark.parametrize("tokens", [1, 6])
def test_triton_lora_matches_reference(outs, tokens):
    kernel = _kernel()
    in_size = 37
    token_slots = [(t % 4) - 1 for t in range(tokens)]
    x = torch.randn(tokens, in_size)
    y0 = torch.randn(tokens, sum(outs))
    want = y0 + _reference(_slots(in_size, outs), x, token_slots)
    slots = _slots(in_size, outs)
    device = "cuda" if CUDA else "cpu"
    y = y0.clone().to(device)
    kernel(
        y,
        x.to(device),
        slots.a.to(device),
        [b.to(device) for b in slots.b],
        torch.tensor(token_slots, device=device),
        3,
        8,
    )
    torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-4)
