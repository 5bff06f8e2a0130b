"""``LoRARequest``: which adapter a request runs with (vLLM's name and fields). Torch-free."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """A PEFT adapter directory, named for the API (``lora_name``) and identified by a positive
    ``lora_int_id`` (the worker caches loaded adapters by it: one id, one directory)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
