"""Checkpoint-slicing helpers the parallel layers' ``weight_loader``s share.

A parameter may carry ``output_dim`` / ``input_dim`` (set by the quant method that created it):
the dimension of the full checkpoint tensor that is split across tensor-parallel ranks for a
column- or row-parallel layer. Dense weights are ``[out, in]`` (0 and 1); a quantized format's
scales or packed weights say their own, so the same loaders slice them.
"""

from __future__ import annotations

import torch

# Which part of a fused parameter a checkpoint tensor fills (None for unfused parameters).
ShardId = int | str | None


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``; ValueError naming ``what`` when it does not divide."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by the tensor-parallel size "
            f"({denominator}); choose a tensor_parallel_size that divides it"
        )
    return numerator // denominator


def narrow_checked(loaded: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """``loaded.narrow`` with a readable error when the checkpoint tensor is too small."""
    if loaded.dim() <= dim or loaded.shape[dim] < start + length:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} has no slice [{start}:{start + length}] along dim {dim}"
        )
    return loaded.narrow(dim, start, length)


def copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy (casting dtype/device) but never broadcast: a shape mismatch is a wrong checkpoint."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded.shape)}, the parameter expects {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def output_dim(param: torch.Tensor) -> int | None:
    """The dimension a column-parallel split cuts (0 for a dense [out, in] weight and a bias;
    None: not split, e.g. GPTQ's per-input g_idx)."""
    return getattr(param, "output_dim", 0)


def pack_factor(param: torch.Tensor, dim: int) -> int:
    """Values per element along ``dim``: 8 where a parameter packs eight 4-bit values into one
    int32 along it (``packed_dim``), else 1."""
    return getattr(param, "pack_factor", 1) if getattr(param, "packed_dim", None) == dim else 1


def divide_packed(size: int, factor: int) -> int:
    """``size`` values in elements of ``factor`` values; ValueError when they do not fill them."""
    if size % factor:
        raise ValueError(
            f"a projection of {size} outputs cannot be cut from a checkpoint tensor that packs {factor} "
            "outputs per element; the checkpoint does not fit this model's shapes"
        )
    return size // factor


def input_dim(param: torch.Tensor) -> int | None:
    """The dimension a row-parallel split cuts (1 for a dense weight; None: not split, a bias)."""
    return getattr(param, "input_dim", 1 if param.dim() == 2 else None)
