"""RMSNorm with an optional fused residual add (the pre-norm decoder's two hot ops in one call)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.custom_op import CustomOp

NormOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class RMSNorm(CustomOp):
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

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> NormOutput:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> NormOutput:
        """One C++ call: torch's rms_norm is a dozen small ops here. With a residual it works in
        place (x and residual are the layer's own fresh tensors): residual += x, then
        x = norm(residual). The kernels take 2-D contiguous rows (per-head QK-norm does not)."""
        if x.dim() != 2 or not x.is_contiguous():
            return self.forward_native(x, residual)
        if residual is None:
            out = torch.empty_like(x)
            self.cpu_ops.rms_norm(out, x, self.weight, self.eps)
            return out
        if not residual.is_contiguous():
            residual = residual.contiguous()
        self.cpu_ops.fused_add_rms_norm_(x, residual, self.weight, self.eps)
        return x, residual
