"""Finding the attention layers of the models a runner owns, and binding their KV caches.

Every model the runner holds (the target, a draft model) is registered the same way: its
``Attention`` modules are found by type, and each gets its own cache tensor over the shared block
ids (a draft model's KV lives in the same blocks as the target's, under the same tables).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterable

import torch

from pagedllm.layers.attention import Attention
from pagedllm.layers.attention.backends.base import AttentionBackend
from pagedllm.worker.host_memory import anonymous_pages


def attention_layers(models: Iterable[torch.nn.Module]) -> list[Attention]:
    """The Attention layers of ``models``, model by model, in module order."""
    return [m for model in models for m in model.modules() if isinstance(m, Attention)]


def bind_kv_caches(
    layers: list[Attention],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
) -> list[torch.Tensor]:
    """Allocate ``[2, num_blocks, block_size, KVH, D]`` per layer, bind it, return the caches."""
    caches = []
    for layer in layers:
        cache = zeroed((2, num_blocks, block_size, layer.num_kv_heads, layer.head_dim), dtype, device)
        layer.bind_kv_cache(cache, backend)
        caches.append(cache)
    return caches


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache. Zeroed, not empty: padded reads of unused slots are masked, but NaN
    garbage would still poison the attention matmul (0 * NaN = NaN). On CPU it is made of fresh
    anonymous pages, which the OS zero-fills on first touch: no start-up pass writing GiBs of
    zeros, and only the blocks in use take memory (in 2 MiB huge pages where the kernel gives
    them: ``host_memory.anonymous_pages``)."""
    if device.type != "cpu" or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    return anonymous_pages(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)
