"""Pick the attention backend for a device (``--attention-backend`` overrides)."""

from __future__ import annotations

from pagedllm.layers.attention.backends.base import AttentionBackend

_BACKENDS = ("torch",)


def get_attn_backend(device_type: str, name: str | None = None) -> AttentionBackend:
    name = name or "torch"
    if name == "torch":
        from pagedllm.layers.attention.backends.torch_sdpa import TorchAttentionBackend
        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(_BACKENDS)}")
