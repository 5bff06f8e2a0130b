"""Tiny random-weight Hugging Face models: the tests' oracle fixtures (and the demo model's body).

Everything is built locally (no hub): the demo tokenizer (``demo/tokenizer.py``) and a config +
random weights saved in the standard HF layout (config.json, safetensors, tokenizer.json,
generation_config.json). torch/transformers are imported lazily, inside the builders.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedllm.demo.tokenizer import IM_END, build_tokenizer

_ARCHES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
_DTYPES = ("float32", "float16", "bfloat16")


def _rope_parameters(rope_scaling: dict | None, rope_theta: float) -> dict:
    """Classic `rope_scaling` dict -> transformers>=5 `rope_parameters` (theta folded in)."""
    params = dict(rope_scaling or {})
    if "type" in params:  # pre-4.45 spelling
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    params["rope_theta"] = float(params.get("rope_theta", rope_theta))
    return params


def _sliding_kwargs(arch: str, sliding_window: int | None) -> dict[str, Any]:
    if sliding_window is None:
        return {"sliding_window": None} if arch == "mistral" else {}
    if arch == "llama":
        raise ValueError("llama has no sliding window; use arch='mistral', 'qwen2' or 'qwen3'")
    if arch == "mistral":
        return {"sliding_window": sliding_window}
    # Qwen: layers with index >= max_window_layers slide; 0 means every layer slides.
    return {"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": 0}


def _validate_args(arch: str, dtype: str, head_dim: int | None, derived_head_dim: int) -> None:
    if arch not in _ARCHES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(_ARCHES)}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {_DTYPES}")
    if arch == "qwen2" and head_dim not in (None, derived_head_dim):
        raise ValueError("qwen2 derives head_dim = hidden_size // num_heads; change those instead")


def _make_config(arch: str, tok: Any, vocab_size: int | None, kw: dict[str, Any]) -> Any:
    import transformers

    if vocab_size is not None and vocab_size < len(tok):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tok)} tokens)")
    config_cls = getattr(transformers, _ARCHES[arch][0])
    return config_cls(
        vocab_size=vocab_size or len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **kw,
    )


def _std_for(name: str, shape: tuple[int, ...]) -> float:
    if "norm" in name:
        return 0.1  # added to 1.0
    if name.endswith("bias"):
        return 0.1
    if "embed_tokens" in name:
        return 0.1  # small, so attention (not the current token) dominates the residual stream
    return (2.0 if "lm_head" in name else 1.0) / shape[-1] ** 0.5


def _reinit_weights(model: Any, seed: int) -> None:
    """HF's std=0.02 init gives flat logits on tiny models (greedy ties); use fan-in scaling."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            noise *= _std_for(name, tuple(p.shape))
            p.copy_(noise + 1.0 if "norm" in name else noise)


def is_complete(path: Path) -> bool:
    has_weights = (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()
    return (path / "config.json").exists() and has_weights


def publish(tmp: Path, path: Path) -> None:
    """Move a finished build into place; a concurrent builder that got there first wins."""
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()
    try:
        os.rename(tmp, path)
    except OSError:
        if not is_complete(path):
            if not path.exists():
                raise
            for f in tmp.iterdir():  # pre-existing non-empty dir: fill it in
                os.replace(f, path / f.name)
        shutil.rmtree(tmp, ignore_errors=True)


def build_tiny_model(
    path: str | os.PathLike,
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    tokenizer_vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    sliding_window: int | None = None,
    dtype: str = "float32",
    shard_size: str | int | None = None,
    **config_overrides: Any,
) -> Path:
    """Build (or reuse, if `path` already holds config.json + weights) a tiny random HF model.

    `rope_scaling` takes the classic dict and lands in config.json as `rope_parameters`
    (with `rope_theta`; pass `rope_theta=` to change it). Returns `path`.
    """
    path = Path(path)
    if is_complete(path):
        return path
    _validate_args(arch, dtype, head_dim, hidden_size // num_heads)
    kw = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
        rope_parameters=_rope_parameters(rope_scaling, config_overrides.pop("rope_theta", 10000.0)),
        **_sliding_kwargs(arch, sliding_window),
    )
    if arch == "qwen2":
        kw.pop("head_dim")  # Qwen2Config has no head_dim field: always hidden_size // num_heads
    tok = build_tokenizer(vocab_size=tokenizer_vocab_size)
    model = _make_model(arch, tok, vocab_size, {**kw, **config_overrides}, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the published dir should be readable like any other
    try:
        with _quiet_progress():
            model.save_pretrained(str(tmp), **({} if shard_size is None else {"max_shard_size": shard_size}))
        tok.save_pretrained(str(tmp))
        publish(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _make_model(arch: str, tok: Any, vocab_size: int | None, config_kw: dict[str, Any], seed: int) -> Any:
    import torch
    import transformers

    config = _make_config(arch, tok, vocab_size, config_kw)
    torch.manual_seed(seed)
    model = getattr(transformers, _ARCHES[arch][1])(config)
    _reinit_weights(model, seed)
    model = model.to(getattr(torch, config_kw["dtype"])).eval()
    # Like Qwen/Llama-3 chat models: generation also stops at the chat turn terminator.
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)]
    return model


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
