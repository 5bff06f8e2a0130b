"""Gated activations for the fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """SwiGLU: the input is ``[gate | up]`` (one fused matmul); returns ``silu(gate) * up``."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward_native(x)
        return self.cpu_ops.silu_and_mul(x)  # one pass, no gate/up temporaries
