"""Pick the attention backend for a device (``--attention-backend`` overrides).

``auto`` (or None): the Triton backend on CUDA when ``triton`` imports, the torch reference backend
elsewhere. ``triton`` on a non-CUDA device runs only under Triton's interpreter (tests).
"""

from __future__ import annotations

from pagedllm import envs
from pagedllm.config.choices import ATTENTION_BACKENDS
from pagedllm.config.device import triton_available
from pagedllm.layers.attention.backends.base import AttentionBackend

BACKEND_CHOICES = ATTENTION_BACKENDS  # the config's table: the CLI offers these


def resolve_backend_name(device_type: str, name: str | None = None) -> str:
    """The concrete backend name for ``name`` (auto/None -> the device's default); ValueError if unknown."""
    name = (name or "auto").lower()
    if name not in BACKEND_CHOICES:
        raise ValueError(f"unknown attention backend {name!r}; choices: {', '.join(BACKEND_CHOICES)}")
    if name == "auto":
        return "triton" if device_type == "cuda" and triton_available() else "torch"
    return name


def get_attn_backend(device_type: str, name: str | None = None) -> AttentionBackend:
    name = resolve_backend_name(device_type, name)
    if name == "triton":
        if not triton_available():
            raise ValueError(
                "attention backend 'triton' needs the triton package (pip install triton); "
                "or use --attention-backend torch"
            )
        if device_type != "cuda" and not envs.triton_interpret():
            raise ValueError(
                f"attention backend 'triton' needs a CUDA device (got {device_type!r}); use "
                "--attention-backend torch, or set TRITON_INTERPRET=1 to run it in Triton's interpreter"
            )
        from pagedllm.layers.attention.backends.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend()
    from pagedllm.layers.attention.backends.torch_sdpa import TorchAttentionBackend

    return TorchAttentionBackend()
