"""Each name table in ``pagedllm.config.choices`` (what the config validates and the CLI offers)
agrees with the implementation behind it, which may import torch and so keeps its own table."""

from __future__ import annotations

import pytest

from pagedllm.config import choices
from pagedllm.model_arch import POOLING_ONLY_ARCHITECTURES, SUPPORTED_ARCHITECTURES


def test_attention_backends_match_the_selector() -> None:
    from pagedllm.layers.attention import selector

    for name in choices.ATTENTION_BACKENDS:
        assert selector.resolve_backend_name("cpu", name) in choices.ATTENTION_BACKENDS


def test_quantization_methods_match_the_layers() -> None:
    from pagedllm.layers import quantization

    assert set(quantization.QUANTIZATION_METHODS) == set(choices.QUANTIZATION_METHODS)
    assert set(quantization.CHECKPOINT_FORMATS) == set(choices.CHECKPOINT_QUANT_METHODS)


def test_tool_call_parsers_match_the_implementations() -> None:
    from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

    assert set(TOOL_PARSERS) == set(choices.TOOL_CALL_PARSERS)


def test_supported_architectures_match_the_registry() -> None:
    from pagedllm.models import registry

    assert set(registry.supported_architectures()) == set(SUPPORTED_ARCHITECTURES)
    for name in SUPPORTED_ARCHITECTURES:
        # Exactly the pooling-only architectures have no LM head to compute logits with.
        model_cls = registry.resolve_model_cls(name)
        has_lm_head = hasattr(model_cls, "compute_logits") and getattr(model_cls, "has_lm_head", True)
        assert has_lm_head == (name not in POOLING_ONLY_ARCHITECTURES), name


def test_structured_outputs_backends_are_known_to_the_manager() -> None:
    pytest.importorskip("xgrammar")
    from pagedllm.demo.tokenizer import build_tokenizer
    from pagedllm.structured_output import manager

    with pytest.raises(ValueError, match="unknown structured outputs backend"):
        manager._create_backend("no-such-backend", None, 0, [])
    tok = build_tokenizer()
    for name in choices.STRUCTURED_OUTPUTS_BACKENDS:
        assert manager._create_backend(name, tok, len(tok), [tok.eos_token_id]) is not None


def test_dtype_table_is_consistent() -> None:
    assert set(choices.DTYPE_ALIASES.values()) <= set(choices.DTYPES) - {"auto"}
    assert set(choices.DTYPE_BYTES) == set(choices.DTYPES) - {"auto"}
