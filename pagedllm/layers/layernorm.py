"""RMSNorm with an optional fused residual add (the pre-norm decoder's two hot ops in one call)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.cpu_kernels import cpu_fp32_kernels


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalising in float32 like Hugging Face.

    ``forward(x)`` returns the normalised x. ``forward(x, residual)`` first forms
    ``x + residual`` (the new residual stream) and returns ``(norm(x + residual), x + residual)``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; bitwise equal to the path below in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # HF casts back to the input dtype *before* scaling by the weight; so do we, to match bitwise.
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        kernels = cpu_fp32_kernels(x)
        if kernels is not None and x.dim() == 2 and x.is_contiguous():
            return self._fused(kernels, x, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _fused(self, kernels, x: torch.Tensor, residual: torch.Tensor | None):
        """One C++ call on CPU float32: torch's rms_norm is a dozen small ops here. With a residual
        it works in place (x and residual are the layer's own fresh tensors): residual += x, then
        x = norm(residual)."""
        if residual is None:
            out = torch.empty_like(x)
            kernels.rms_norm(out, x, self.weight, self.eps)
            return out
        if not residual.is_contiguous():
            residual = residual.contiguous()
        kernels.fused_add_rms_norm_(x, residual, self.weight, self.eps)
        return x, residual
