"""Gated activations for the fused gate/up projection, and the plain ones encoder MLPs use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


# HF ``hidden_act`` -> the plain (ungated) activation; "gelu" is the exact erf form.
_ACTIVATIONS: dict[str, tuple[type[nn.Module], dict[str, str]]] = {
    "gelu": (nn.GELU, {}),
    "gelu_new": (nn.GELU, {"approximate": "tanh"}),
    "gelu_fast": (nn.GELU, {"approximate": "tanh"}),
    "gelu_pytorch_tanh": (nn.GELU, {"approximate": "tanh"}),
    "relu": (nn.ReLU, {}),
    "silu": (nn.SiLU, {}),
    "swish": (nn.SiLU, {}),
}


def get_act_fn(name: str) -> nn.Module:
    """The activation module for a config's ``hidden_act`` (encoders' MLPs are not gated)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={name!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}")
    cls, kwargs = _ACTIVATIONS[name]
    return cls(**kwargs)
