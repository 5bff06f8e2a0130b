"""Hugging Face ``architectures[0]`` -> our model class. Torch-free at import: the config layer
validates architecture names without loading torch; model modules are imported on resolve."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

# architecture -> (module under pagedllm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),  # Llama + sliding window (from the config)
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    # Bare decoder bodies (AutoModel's layout, no LM head): for pooling only.
    "LlamaModel": ("llama", "LlamaEmbeddingModel"),
    "MistralModel": ("llama", "LlamaEmbeddingModel"),
    "Qwen2Model": ("qwen2", "Qwen2EmbeddingModel"),
    "Qwen3Model": ("qwen3", "Qwen3EmbeddingModel"),
    # Encoders: one class; RoBERTa's position offset and token types come from the config.
    "BertModel": ("bert", "BertModel"),
    "RobertaModel": ("bert", "BertModel"),
    "XLMRobertaModel": ("bert", "BertModel"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_cls(architecture: str) -> type[nn.Module]:
    """The model class for ``architecture``; ValueError naming the supported ones if unknown."""
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"pagedllm.models.{module_name}")
    return getattr(module, class_name)
