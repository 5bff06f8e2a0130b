"""Multi-LoRA serving. ``request`` and ``peft_files`` are torch-free (the front end validates
adapters with them); ``layers`` and ``manager`` hold the worker's device slots (torch)."""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
