"""Architecture name -> model class, and the registry's torch-free import."""

import subprocess
import sys

import pytest

from pagedllm.models.registry import resolve_model_cls, supported_architectures


def test_supported_architectures():
    assert supported_architectures() == [
        "BertModel",
        "LlamaForCausalLM",
        "LlamaModel",
        "MistralForCausalLM",
        "MistralModel",
        "Qwen2ForCausalLM",
        "Qwen2Model",
        "Qwen3ForCausalLM",
        "Qwen3Model",
        "RobertaModel",
        "XLMRobertaModel",
    ]


@pytest.mark.parametrize(
    "architecture, module, cls",
    [
        ("LlamaForCausalLM", "pagedllm.models.llama", "LlamaForCausalLM"),
        ("MistralForCausalLM", "pagedllm.models.llama", "LlamaForCausalLM"),
        ("Qwen2ForCausalLM", "pagedllm.models.qwen2", "Qwen2ForCausalLM"),
        ("Qwen3ForCausalLM", "pagedllm.models.qwen3", "Qwen3ForCausalLM"),
        ("LlamaModel", "pagedllm.models.llama", "LlamaEmbeddingModel"),
        ("MistralModel", "pagedllm.models.llama", "LlamaEmbeddingModel"),
        ("Qwen2Model", "pagedllm.models.qwen2", "Qwen2EmbeddingModel"),
        ("Qwen3Model", "pagedllm.models.qwen3", "Qwen3EmbeddingModel"),
    ],
)
def test_resolve(architecture, module, cls):
    model_cls = resolve_model_cls(architecture)
    assert (model_cls.__module__, model_cls.__name__) == (module, cls)
    for method in ("forward", "compute_logits", "load_weights"):
        assert callable(getattr(model_cls, method))
    assert model_cls.packed_modules_mapping == {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }


@pytest.mark.parametrize("architecture", ["BertModel", "RobertaModel", "XLMRobertaModel"])
def test_resolve_encoders(architecture):
    model_cls = resolve_model_cls(architecture)
    assert (model_cls.__module__, model_cls.__name__) == ("pagedllm.models.bert", "BertModel")
    assert model_cls.packed_modules_mapping == {"qkv_proj": ["query", "key", "value"]}
    assert not hasattr(model_cls, "compute_logits")


def test_unknown_architecture_lists_supported():
    with pytest.raises(
        ValueError,
        match="architecture GPT2LMHeadModel is not supported; supported: BertModel, LlamaForCausalLM, "
        "LlamaModel, MistralForCausalLM",
    ):
        resolve_model_cls("GPT2LMHeadModel")


def test_registry_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from pagedllm.models.registry import supported_architectures\n"
        "assert 'LlamaForCausalLM' in supported_architectures()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
