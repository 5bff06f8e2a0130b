"""The device and its kernels: ``DeviceArgs`` (resolved into ``EngineConfig``'s device fields)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from pagedllm import envs
from pagedllm.config.choices import ATTENTION_BACKENDS, DEVICES
from pagedllm.config.options import check_choice, option


def triton_available() -> bool:
    """Whether triton is installed (without importing it: under the interpreter, import order matters)."""
    return importlib.util.find_spec("triton") is not None


@dataclass
class DeviceArgs:
    """Where the model runs and which kernels it uses there."""

    device: str = option(
        "auto", "device; auto = $PAGEDLLM_DEVICE if set, else cuda if present, else cpu", choices=DEVICES
    )
    attention_backend: str | None = option(
        "auto",
        "attention kernels: auto = triton on CUDA (when triton is installed), torch elsewhere",
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool = option(
        False,
        "CUDA: run every step eagerly, without capturing CUDA graphs for decode "
        "batches (faster start-up, slower decode)",
    )

    def resolve_device(self) -> str:
        """cpu or cuda. Torch is imported only here, and only to look for a GPU."""
        device = self.device
        if device not in DEVICES:
            raise ValueError(f"device must be auto, cpu or cuda; got {device!r}")
        if device != "auto":
            return device
        override = envs.device_override()
        if override is not None:
            return override
        try:
            import torch
        except ImportError:
            return "cpu"
        return "cuda" if torch.cuda.is_available() else "cpu"

    def check_attention_backend(self) -> None:
        if self.attention_backend is not None:  # None: the same as auto
            check_choice("attention_backend", self.attention_backend.lower(), ATTENTION_BACKENDS)
