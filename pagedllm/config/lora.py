"""Multi-LoRA serving: ``LoRAArgs`` -> frozen ``LoRAConfig`` (None when LoRA is off). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config.options import check_choice, check_positive, option

# The adapters' slot dtypes: "auto" is the model's dtype; bfloat16 halves the bytes a step reads
# for them (the CPU kernel widens them to float32 in registers; the sums stay float32).
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")

# The ranks an adapter may have, as vLLM allows them (the slot buffers are sized by the largest).
SUPPORTED_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # adapters one step may use (device slots)
    max_lora_rank: int = 16  # every adapter's rank is at most this (slots are this wide)
    max_cpu_loras: int = 1  # adapters kept loaded in host memory (>= max_loras)
    lora_dtype: str = "auto"  # the slots' dtype (LORA_DTYPES; auto: the model's)


@dataclass
class LoRAArgs:
    """LoRA adapters served on top of the base model (PEFT format), several in one batch."""

    enable_lora: bool = option(False, "serve LoRA adapters (PEFT format) on top of the base model")
    max_loras: int = option(1, "the most distinct LoRA adapters one step may run (device slots)")
    max_lora_rank: int = option(16, "the largest LoRA rank an adapter may have (slots are this wide)")
    max_cpu_loras: int | None = option(
        None, "LoRA adapters kept loaded in host memory (LRU); at least max_loras", default_help="max_loras"
    )
    lora_dtype: str = option(
        "auto",
        "dtype the adapters' A and B are kept in (auto: the model's); bfloat16 on a float32 model halves "
        "the adapter bytes each step reads, computing in float32",
        choices=LORA_DTYPES,
    )

    def create_lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        check_positive("max_loras", self.max_loras)
        check_positive("max_lora_rank", self.max_lora_rank)
        cpu = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        check_positive("max_cpu_loras", cpu)
        if cpu < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({cpu}) must be at least max_loras ({self.max_loras}): raise max_cpu_loras "
                "or leave it unset"
            )
        check_choice("lora_dtype", self.lora_dtype, LORA_DTYPES)
        return LoRAConfig(self.max_loras, self.max_lora_rank, cpu, self.lora_dtype)
