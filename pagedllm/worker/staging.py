"""Moving a step's host-built index arrays to the device.

Every per-step tensor the runner needs (token ids, positions, slot mapping, block table, sequence
lengths, query offsets, sampled rows) is built with numpy on the host. On CPU the tensors are
zero-copy views of those arrays. On CUDA, six or seven small ``.to(device)`` calls would each pay
a launch and a synchronous pageable copy, so they are packed into one pinned host buffer and moved
with a single asynchronous copy; the device tensors are views into that one allocation.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 8  # int64 elements: 64 bytes


class HostStager:
    """Stages int64 arrays onto ``device``: zero-copy (CPU) or packed into one copy (CUDA).

    ``pack`` / ``pin`` default to ``device.type == "cuda"``; tests pass ``pack=True, pin=False``
    to run the packing path on CPU (pinned memory needs a CUDA driver).
    """

    def __init__(self, device: torch.device | str, pack: bool | None = None, pin: bool | None = None) -> None:
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        self.pack = on_cuda if pack is None else pack
        self.pin = on_cuda if pin is None else pin
        self._host = torch.empty(0, dtype=torch.int64)
        # Recorded after each copy: the host buffer may only be rewritten once the GPU has read it.
        self._copied: torch.cuda.Event | None = None

    def stage(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The same names -> int64 tensors on the device, with the arrays' shapes."""
        arrays = {name: np.ascontiguousarray(a, dtype=np.int64) for name, a in arrays.items()}
        if not self.pack:
            return {name: torch.from_numpy(a).to(self.device) for name, a in arrays.items()}
        offsets = _aligned_offsets([a.size for a in arrays.values()])
        host = self._host_buffer(offsets[-1])
        host_np = host.numpy()
        for a, offset in zip(arrays.values(), offsets):
            host_np[offset : offset + a.size] = a.ravel()
        device_buf = torch.empty(offsets[-1], dtype=torch.int64, device=self.device)
        device_buf.copy_(host[: offsets[-1]], non_blocking=self.pin)
        self._record_copy()
        return {name: device_buf[o : o + a.size].view(a.shape) for (name, a), o in zip(arrays.items(), offsets)}

    def _host_buffer(self, size: int) -> torch.Tensor:
        """The reusable host buffer, once the previous copy out of it has finished; grown if too small."""
        if self._copied is not None:
            self._copied.synchronize()  # normally long done: each step ends by reading sampled ids
            self._copied = None
        if self._host.numel() < size:
            capacity = max(size, 2 * self._host.numel(), 4096)
            self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=self.pin)
        return self._host

    def _record_copy(self) -> None:
        if self.pin and self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()


def _aligned_offsets(sizes: list[int]) -> list[int]:
    """Start of each array in the packed buffer, then the total. Starts are 64-byte aligned: Triton
    specialises kernels on 16-byte pointer alignment, so an unaligned view would compile (and pick)
    a second variant depending on the lengths of the arrays before it."""
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + -(-size // _ALIGN) * _ALIGN)
    return offsets
