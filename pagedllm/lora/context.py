"""The one scoped context a step's LoRA mapping rides in (torch-free).

The model runner enters ``lora_step(mapping)`` around the forward of a step that has adapter
rows; LoRA-wrapped linears read ``current_lora_step()`` and add their deltas, and the CPU decode
stack (which cannot add them) stands aside. Outside a step, and in steps with only base-model
rows, it is None and the linears run exactly as without LoRA.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_current: Any = None


@contextmanager
def lora_step(mapping: Any) -> Iterator[None]:
    """Make ``mapping`` (a ``lora.layers.LoRAStep``) the current step's for the ``with`` body."""
    global _current
    previous, _current = _current, mapping
    try:
        yield
    finally:
        _current = previous


def current_lora_step() -> Any:
    """The running step's LoRA mapping, or None (no step, or no adapter rows in it)."""
    return _current
