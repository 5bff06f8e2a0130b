"""The boundary to Hugging Face checkpoints: ``config.json`` normalised into our own frozen
:class:`ModelArchConfig` (torch-free).

Both the classic spelling (``rope_theta`` + ``rope_scaling``) and transformers 5's
``rope_parameters`` are accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedllm.gguf_config import gguf_arch_config, is_gguf_file
from pagedllm.model_arch import ENCODER_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ModelArchConfig, RopeConfig
from pagedllm.models.registry import supported_architectures

# RoBERTa-style encoders number positions from pad_token_id + 1 (HF's create_position_ids_from_input_ids).
_OFFSET_POSITION_ARCHITECTURES = ("RobertaModel", "XLMRobertaModel")


def load_arch_config(model_path: str | Path) -> ModelArchConfig:
    """The architecture of a checkpoint: a GGUF file's metadata, else a directory's ``config.json``."""
    if is_gguf_file(model_path):
        return gguf_arch_config(model_path)
    return normalize_hf_config(load_hf_config(model_path))


def load_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """Read ``config.json`` from a model directory with a clear error when it is missing."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{model_dir!s} is not a Hugging Face model directory: no config.json in it. "
            "Pass a local directory that holds config.json, *.safetensors and the tokenizer files."
        )
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _causal_lm_of(model_type: str) -> list[str]:
    """[the causal LM of ``model_type``] (``llama`` -> LlamaForCausalLM, as transformers names it)
    where pagedllm builds it: for a config.json written without ``architectures`` (a GGUF-loaded
    model's config saved as it is); [] otherwise."""
    return [name for name in supported_architectures() if model_type and name.lower() == f"{model_type}forcausallm"]


def normalize_hf_config(hf: dict[str, Any]) -> ModelArchConfig:
    """Map the many spellings of Llama/Mistral/Qwen2/Qwen3 (and BERT-family) configs onto one dataclass."""
    hf = dict(hf.get("text_config") or {}, **{k: v for k, v in hf.items() if k != "text_config"})
    architectures = hf.get("architectures") or _causal_lm_of(str(hf.get("model_type", "")))
    if not architectures:
        raise ValueError(
            "config.json has no 'architectures' entry (and its model_type names no causal LM that pagedllm "
            'builds); cannot tell which model class to build: add e.g. "architectures": ["LlamaForCausalLM"]'
        )
    if architectures[0] in ENCODER_ARCHITECTURES:
        return _normalize_encoder(hf, architectures[0])
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // heads
    model_type = str(hf.get("model_type", ""))
    return ModelArchConfig(
        architecture=architectures[0],
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope_config(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hidden_act=str(hf.get("hidden_act", "silu")),
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_windows=_sliding_windows(hf, int(hf["num_hidden_layers"])),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_as_tuple(hf.get("eos_token_id")),
        torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
        extra={k: hf[k] for k in ("sliding_window", "layer_types", "quantization_config") if k in hf},
    )


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _rope_config(hf: dict[str, Any]) -> RopeConfig:
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    known = RopeConfig.__dataclass_fields__
    kwargs = {k: v for k, v in params.items() if k in known and v is not None}
    if "partial_rotary_factor" in hf:
        kwargs["partial_rotary_factor"] = hf["partial_rotary_factor"]
    return RopeConfig(theta=theta, rope_type=rope_type, **kwargs)


def _sliding_windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if not window or hf.get("use_sliding_window") is False:
        return (None,) * num_layers
    layer_types = hf.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if "max_window_layers" in hf and "use_sliding_window" in hf:
        # Qwen2 convention: layers at index >= max_window_layers use the window.
        start = int(hf["max_window_layers"])
        return tuple(window if i >= start else None for i in range(num_layers))
    return (int(window),) * num_layers


def _normalize_encoder(hf: dict[str, Any], architecture: str) -> ModelArchConfig:
    """BERT / RoBERTa / XLM-R: post-norm encoders with learned absolute positions, biased
    linears everywhere and a LayerNorm (not RMSNorm)."""
    _check_encoder(hf)
    heads, hidden, layers = int(hf["num_attention_heads"]), int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    offset = _position_offset(hf, architecture)
    eps = float(hf.get("layer_norm_eps", 1e-12))
    return ModelArchConfig(
        architecture=architecture,
        model_type=str(hf.get("model_type", "")),
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        # The table holds `offset` rows no token can use: 514 rows -> 512 usable positions.
        max_position_embeddings=int(hf.get("max_position_embeddings", 512)) - offset,
        rms_norm_eps=eps,  # unused (encoders normalise with LayerNorm); kept equal to avoid a second value
        rope=RopeConfig(),
        hidden_act=str(hf.get("hidden_act", "gelu")),
        attention_bias=True,
        mlp_bias=True,
        sliding_windows=(None,) * layers,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_as_tuple(hf.get("eos_token_id")),
        torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
        encoder_only=True,
        layer_norm_eps=eps,
        type_vocab_size=int(hf.get("type_vocab_size", 2)),
        position_offset=offset,
        pad_token_id=hf.get("pad_token_id"),
    )


def _position_offset(hf: dict[str, Any], architecture: str) -> int:
    if architecture not in _OFFSET_POSITION_ARCHITECTURES:
        return 0
    pad = hf.get("pad_token_id")
    return (1 if pad is None else int(pad)) + 1


def _check_encoder(hf: dict[str, Any]) -> None:
    kind = hf.get("position_embedding_type") or "absolute"
    if kind != "absolute":
        raise ValueError(
            f"position_embedding_type={kind!r} is not supported for encoder models; only 'absolute' "
            "(learned position embeddings) is implemented"
        )
    if hf.get("is_decoder"):
        raise ValueError("is_decoder=true turns a BERT-family model causal; only bidirectional encoders are supported")
