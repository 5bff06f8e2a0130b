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

from pagedllm.demo.tokenizer import IM_END, build_encoder_tokenizer, build_tokenizer

_ARCHES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
_DTYPES = ("float32", "float16", "bfloat16")
# Encoders: arch -> (config class, model class, tokenizer style).
_ENCODERS = {
    "bert": ("BertConfig", "BertModel", "bert"),
    "roberta": ("RobertaConfig", "RobertaModel", "roberta"),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", "roberta"),
}
# sentence-transformers pooling modes (1_Pooling/config.json keys) by our short name.
POOLING_MODES = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
    "last": "pooling_mode_lasttoken",
}


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
    if "norm" in name.lower():  # BERT's are LayerNorm
        return 0.1  # added to 1.0
    if name.endswith("bias"):
        return 0.1
    if "embed_tokens" in name or "embeddings" in name:
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
            p.copy_(noise + 1.0 if "norm" in name.lower() else noise)


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
    bare: bool = False,
    **config_overrides: Any,
) -> Path:
    """Build (or reuse, if `path` already holds config.json + weights) a tiny random HF model.

    `rope_scaling` takes the classic dict and lands in config.json as `rope_parameters`
    (with `rope_theta`; pass `rope_theta=` to change it). `bare`: save the body alone, as
    `AutoModel` does (architecture `LlamaModel` etc.: no LM head, no `model.` prefix on the
    tensor names), like decoder embedding models. Returns `path`.
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
    model = _make_model(arch, tok, vocab_size, {**kw, **config_overrides}, seed, bare)
    _save(path, model, tok, {} if shard_size is None else {"max_shard_size": shard_size})
    return path


def _save(path: Path, model: Any, tok: Any, save_kw: dict[str, Any], extra_files: dict[str, str] | None = None) -> None:
    """Save model, tokenizer and ``extra_files`` (relative path -> text) into a fresh dir, then publish it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the published dir should be readable like any other
    try:
        with _quiet_progress():
            model.save_pretrained(str(tmp), **save_kw)
        tok.save_pretrained(str(tmp))
        for name, text in (extra_files or {}).items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(text, encoding="utf-8")
        publish(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_model(
    arch: str, tok: Any, vocab_size: int | None, config_kw: dict[str, Any], seed: int, bare: bool = False
) -> Any:
    import torch
    import transformers

    config = _make_config(arch, tok, vocab_size, config_kw)
    torch.manual_seed(seed)
    config_cls, model_cls = _ARCHES[arch]
    model = getattr(transformers, config_cls.removesuffix("Config") + "Model" if bare else model_cls)(config)
    _reinit_weights(model, seed)
    model = model.to(getattr(torch, config_kw["dtype"])).eval()
    if not bare:  # a bare body cannot generate, so it has no generation config
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


def build_tiny_encoder(
    path: str | os.PathLike,
    arch: str = "bert",
    *,
    pooling: str | None = "mean",
    normalize: bool = True,
    seed: int = 0,
    tokenizer_vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_position_embeddings: int = 128,
    **config_overrides: Any,
) -> Path:
    """Build (or reuse) a tiny random BERT-family encoder in the HF layout (``BertModel`` with its
    pooler, ``RobertaModel``, ``XLMRobertaModel``; `arch` "bert", "roberta", "xlm-roberta") with a
    WordPiece tokenizer that adds [CLS]/[SEP] (RoBERTa: <s>/</s>, pad id 1).

    `pooling` ("cls", "mean", "max", "mean_sqrt_len", "last"; None for plain HF files) adds the
    sentence-transformers files: modules.json, 1_Pooling/config.json and, with `normalize`, a
    2_Normalize module. `max_position_embeddings` is the usable length; RoBERTa-style configs get
    the table size (+ pad_token_id + 1) as the real ones do. Returns `path`.
    """
    path = Path(path)
    if is_complete(path):
        return path
    if arch not in _ENCODERS:
        raise ValueError(f"unknown encoder arch {arch!r}; choose one of {sorted(_ENCODERS)}")
    if pooling is not None and pooling not in POOLING_MODES:
        raise ValueError(f"pooling={pooling!r}; choose one of {sorted(POOLING_MODES)} or None")
    tok = build_encoder_tokenizer(style=_ENCODERS[arch][2], vocab_size=tokenizer_vocab_size)
    config_kw = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        **config_overrides,
    )
    model = _make_encoder(arch, tok, config_kw, seed)
    extra = (
        {} if pooling is None else sentence_transformers_files(hidden_size, pooling, normalize, max_position_embeddings)
    )
    _save(path, model, tok, {}, extra)
    return path


def _make_encoder(arch: str, tok: Any, config_kw: dict[str, Any], seed: int) -> Any:
    import torch
    import transformers

    config_cls, model_cls, style = _ENCODERS[arch]
    if style == "roberta":  # positions start at pad_token_id + 1, one token type
        config_kw = {**config_kw, "type_vocab_size": 1, "bos_token_id": tok.cls_token_id}
        config_kw["max_position_embeddings"] += tok.pad_token_id + 1
        config_kw["eos_token_id"] = tok.sep_token_id
    config = getattr(transformers, config_cls)(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **config_kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    _reinit_weights(model, seed)
    return model.eval()


def sentence_transformers_files(
    hidden_size: int, pooling: str, normalize: bool, max_seq_length: int = 512
) -> dict[str, str]:
    """modules.json and 1_Pooling/config.json (relative path -> JSON text) for a
    Transformer -> Pooling [-> Normalize] sentence-transformers pipeline."""
    import json

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    pooling_config: dict[str, Any] = {"word_embedding_dimension": hidden_size}
    pooling_config.update({key: name == pooling for name, key in POOLING_MODES.items()})
    pooling_config.update({"pooling_mode_weightedmean_tokens": False, "include_prompt": True})
    return {
        "modules.json": json.dumps(modules, indent=2),
        "1_Pooling/config.json": json.dumps(pooling_config, indent=2),
        "sentence_bert_config.json": json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}),
    }
