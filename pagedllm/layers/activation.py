"""Gated activations for the fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.cpu_kernels import cpu_fp32_kernels


class SiluAndMul(nn.Module):
    """SwiGLU: the input is ``[gate | up]`` (one fused matmul); returns ``silu(gate) * up``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_fp32_kernels(x)
        if kernels is not None and x.dim() == 2:
            return kernels.silu_and_mul(x)  # one pass, no gate/up temporaries
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
