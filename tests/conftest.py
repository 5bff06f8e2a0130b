"""Shared pytest fixtures. Append new fixtures in their own section below."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# No hub access exists here or in CI: fail fast instead of trying the network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _without_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Triton kernels run on CPU only under its interpreter, and triton reads the flag when it is first
# imported (by anything): set it before any test can import triton, so the kernel tests run in CI.
if _without_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# --- tiny random-weight HF models (the correctness oracle) ---------------------------------------

TinyModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """`tiny_model_dir(arch, **kw)` -> dir of a tiny HF model; built once per session per kwargs."""
    from pagedllm.demo.tiny import build_tiny_model

    return _built_once(tmp_path_factory.mktemp("tiny_models"), build_tiny_model, "llama")


def _built_once(root: Path, build: Callable[..., Path], default_arch: str) -> TinyModelFactory:
    """``build(dir, arch, **kw)`` once per (arch, kw) under ``root``; later calls reuse the dir."""
    built: dict[str, Path] = {}

    def make(arch: str = default_arch, **kw: Any) -> Path:
        key = f"{arch}-{hashlib.sha1(repr(sorted(kw.items())).encode()).hexdigest()[:12]}"
        if key not in built:
            built[key] = build(root / key, arch, **kw)
        return built[key]

    return make


@pytest.fixture(scope="session")
def llama_model_dir(tiny_model_dir: TinyModelFactory) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def mistral_model_dir(tiny_model_dir: TinyModelFactory) -> Path:
    return tiny_model_dir("mistral", sliding_window=32, max_position_embeddings=512)


@pytest.fixture(scope="session")
def qwen2_model_dir(tiny_model_dir: TinyModelFactory) -> Path:
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="session")
def qwen3_model_dir(tiny_model_dir: TinyModelFactory) -> Path:
    return tiny_model_dir("qwen3")


# --- tiny encoders and bare decoder bodies (embedding models) ------------------------------------


@pytest.fixture(scope="session")
def tiny_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """`tiny_encoder_dir(arch="bert", **kw)` -> dir of a tiny HF encoder with sentence-transformers
    files (see ``build_tiny_encoder``); built once per session per arguments."""
    from pagedllm.demo.tiny import build_tiny_encoder

    return _built_once(tmp_path_factory.mktemp("tiny_encoders"), build_tiny_encoder, "bert")


@pytest.fixture(scope="session")
def bert_model_dir(tiny_encoder_dir: TinyModelFactory) -> Path:
    """A tiny ``BertModel`` with mean pooling and a Normalize module (like all-MiniLM-L6-v2)."""
    return tiny_encoder_dir("bert", pooling="mean", normalize=True)


@pytest.fixture(scope="session")
def bare_qwen3_model_dir(tiny_model_dir: TinyModelFactory) -> Path:
    """A tiny ``Qwen3Model``: the body alone, as Qwen3-Embedding-style checkpoints are saved."""
    return tiny_model_dir("qwen3", bare=True)
