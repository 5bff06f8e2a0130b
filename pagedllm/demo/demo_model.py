"""The built-in demo model (random weights) and the entry step that substitutes it when no
model is given. Only the entrypoints call this, before the engine config is created: config
creation itself never builds or trains anything."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm import envs
from pagedllm.config.model import DEMO_MODEL_NAME
from pagedllm.demo.tiny import build_tiny_model, is_complete, publish

if TYPE_CHECKING:
    from pagedllm.config import EngineArgs

_DEMO_README = f"""# {DEMO_MODEL_NAME}: RANDOM WEIGHTS, GIBBERISH OUTPUT

**WARNING: this model's weights are RANDOM. It has never been trained. Everything it
generates is GIBBERISH.** It exists only so that `pagedllm serve` has a real
Llama-architecture model to run with no downloads (its tokenizer is a byte-level BPE trained
on a small built-in corpus). Built by `pagedllm.demo.demo_model.ensure_demo_model()`; delete this
directory to rebuild it.
"""


def default_cache_dir() -> Path:
    """`$PAGEDLLM_CACHE`, else `~/.cache/pagedllm`."""
    return envs.cache_dir()


def ensure_demo_model() -> Path:
    """Build the demo model once into `<cache>/demo-llama` (atomically) and return its path."""
    path = default_cache_dir() / "demo-llama"
    if is_complete(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-llama.build-", dir=path.parent))
    try:
        build_tiny_model(
            staging / "model",
            "llama",
            seed=0,
            tokenizer_vocab_size=2048,
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=688,
            max_position_embeddings=2048,
        )
        (staging / "model" / "README.md").write_text(_DEMO_README)
        publish(staging / "model", path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def with_demo_model(args: EngineArgs) -> EngineArgs:
    """``args`` with the demo model filled in when no model is given (None or "pagedllm-demo"),
    served as "pagedllm-demo"; other args unchanged. Builds the model on first use."""
    if args.model not in (None, DEMO_MODEL_NAME):
        return args
    return dataclasses.replace(
        args, model=str(ensure_demo_model()), served_model_name=args.served_model_name or DEMO_MODEL_NAME
    )
