"""Adapters made at test time with ``peft`` on the tiny models, and the HF + PEFT oracle."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
AdapterFactory = Callable[..., Path]


def build_adapter(base_dir: Path, out_dir: Path, *, seed: int, r: int = 8, alpha: int = 16, **lora_kw: Any) -> Path:
    """A PEFT LoRA adapter of the model at ``base_dir`` with random, non-zero A and B (peft
    initialises B to zero, which would make every adapter the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora_kw.setdefault("target_modules", ALL_TARGETS)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, **lora_kw))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def make_adapter(tmp_path_factory: pytest.TempPathFactory) -> AdapterFactory:
    """``make_adapter(base_dir, seed=..., r=..., ...)`` -> adapter dir; built once per arguments."""
    root = tmp_path_factory.mktemp("adapters")
    built: dict[str, Path] = {}

    def make(base_dir: Path, **kw: Any) -> Path:
        key = json.dumps([str(base_dir), sorted(kw.items())], default=str)
        if key not in built:
            built[key] = build_adapter(base_dir, root / f"adapter{len(built)}", **kw)
        return built[key]

    return make


def hf_greedy(base_dir: Path, adapter_dir: Path | None, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens of transformers (+ PEFT with ``adapter_dir``), float32, with its KV cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    tokens: list[int] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens
