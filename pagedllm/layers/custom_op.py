"""Ops with a torch reference and per-device kernels, dispatched in one place.

A :class:`CustomOp` implements ``forward_native`` (plain torch: the reference, and what every
device can run) and may override ``forward_cpu`` / ``forward_cuda``. Which one runs is decided
once, on the first call, from the device and dtype of the tensor the op computes on
(:meth:`CustomOp.dispatch_key`), and bound to the instance: later calls go straight to it, with
no per-call device tests. The CPU kernels (``csrc/``, built for the host's ISA by
``layers/cpu_kernels.py``) take float32; a CPU op in another dtype, or with the kernels off
(``PAGEDLLM_CPU_KERNELS=0``) or unbuilt, runs ``forward_native``. ``force_native()`` pins the
reference (tests; a backend told not to use kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.layers.cpu_kernels import cpu_fp32_kernels


class CustomOp(nn.Module):
    """Base of the layers with device kernels (norms, RoPE, SiLU-and-mul, the KV-cache write)."""

    def __init__(self) -> None:
        super().__init__()
        self._forward_method: Callable[..., Any] = self._dispatch_first_call
        self.cpu_ops: Any = None  # torch.ops.pagedllm_<isa> once forward_cpu is chosen

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """The reference implementation in plain torch."""
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        """The CPU kernel path (float32 CPU tensors, ``self.cpu_ops`` loaded)."""
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def dispatch_key(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The tensor whose device and dtype choose the implementation (the first argument)."""
        return args[0]

    def dispatch(self, x: torch.Tensor) -> Callable[..., Any]:
        """The implementation for tensors like ``x``."""
        if x.device.type == "cpu":
            self.cpu_ops = cpu_fp32_kernels(x)
            return self.forward_cpu if self.cpu_ops is not None else self.forward_native
        if x.device.type == "cuda":
            return self.forward_cuda
        return self.forward_native

    def force_native(self) -> CustomOp:
        """Always run ``forward_native`` from now on; returns self."""
        self._forward_method = self.forward_native
        return self

    @property
    def forward_method(self) -> Callable[..., Any] | None:
        """The implementation bound by the first call (None before it)."""
        method = self._forward_method
        return None if getattr(method, "__func__", None) is CustomOp._dispatch_first_call else method

    def _dispatch_first_call(self, *args: Any, **kwargs: Any) -> Any:
        self._forward_method = self.dispatch(self.dispatch_key(*args, **kwargs))
        return self._forward_method(*args, **kwargs)
