"""The boundary to GGUF checkpoints (llama.cpp's single-file format): the file's metadata
normalised into our own frozen :class:`ModelArchConfig`.

Torch-free: the header is parsed by ``gguf_metadata.py`` (struct only); the ``gguf`` package
(numpy) is imported only to check tensor sizes. ``models/gguf_loader.py`` reads the tensors.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

from pagedllm.gguf_metadata import ArrayLen, GGUFMetadata, read_gguf_metadata
from pagedllm.model_arch import ModelArchConfig, RopeConfig

GGUF_SUFFIX = ".gguf"
# general.architecture -> the Hugging Face class name our registry builds.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_ROPE_SCALING_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}


def is_gguf_file(path: str | Path) -> bool:
    """A path that names a GGUF file (by its suffix; reading its header checks the magic)."""
    return Path(path).suffix.lower() == GGUF_SUFFIX and Path(path).is_file()


def resolve_gguf_path(model: str | Path) -> Path:
    """``model`` itself when it is a .gguf file, else the one .gguf file in the directory ``model``."""
    path = Path(model)
    if is_gguf_file(path):
        return path
    found = sorted(path.glob(f"*{GGUF_SUFFIX}")) if path.is_dir() else []
    if len(found) != 1:
        what = "none" if not found else ", ".join(p.name for p in found)
        raise ValueError(
            f"load_format='gguf' needs a .gguf file or a directory with exactly one; {model} holds {what}. "
            "Pass the .gguf file itself"
        )
    return found[0]


def resolve_checkpoint(model: str, load_format: str) -> str:
    """The path the weights load from: with ``load_format='gguf'`` the .gguf file (a directory's
    only one); a .gguf file with ``load_format='safetensors'`` is an error."""
    if load_format == "gguf":
        return str(resolve_gguf_path(model))
    if load_format == "safetensors" and is_gguf_file(model):
        raise ValueError(f"{model} is a GGUF file, not safetensors; pass load_format 'auto' or 'gguf'")
    return model


def read_metadata(path: str | Path) -> GGUFMetadata:
    """The file's header (metadata and tensor table), checked to hold every tensor's bytes."""
    try:
        meta = read_gguf_metadata(path)
    except (ValueError, struct.error, OSError) as exc:
        raise _unreadable(path, exc) from exc
    _check_complete(meta, path)
    return meta


def _unreadable(path: str | Path, exc: Exception) -> ValueError:
    return ValueError(
        f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
        "it may be truncated or corrupt: download or convert it again"
    )


def _check_complete(meta: GGUFMetadata, path: str | Path) -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, info in meta.tensors.items():
        try:
            block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        except ValueError:
            raise ValueError(
                f"{path}: tensor {name!r} has GGML type id {info.ggml_type}, which the gguf package does not know; "
                "upgrade gguf (pip install -U gguf) or convert the model to a common type (Q8_0, Q4_K, F16)"
            ) from None
        end = meta.data_offset + info.offset + math.prod(info.shape) // block * nbytes
        if end > meta.file_size:
            raise _unreadable(path, ValueError(f"tensor {name!r} ends at byte {end}, the file has {meta.file_size}"))


def gguf_arch_config(path: str | Path) -> ModelArchConfig:
    """The architecture of the GGUF file at ``path`` (its header only: the tensors are not read)."""
    meta = _Metadata(read_metadata(path), path)
    arch = meta.architecture()
    tensors = meta.header.tensors
    _check_rope_freqs(set(tensors), path)
    heads = meta.integer(f"{arch}.attention.head_count")
    hidden = meta.integer(f"{arch}.embedding_length")
    layers = meta.integer(f"{arch}.block_count")
    return ModelArchConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        model_type=arch,
        vocab_size=_vocab_size(meta, arch),
        hidden_size=hidden,
        intermediate_size=meta.integer(f"{arch}.feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=meta.integer(f"{arch}.attention.head_count_kv", heads),
        head_dim=meta.integer(f"{arch}.attention.key_length", hidden // heads),
        max_position_embeddings=meta.integer(f"{arch}.context_length", 2048),
        rms_norm_eps=_float32_repr(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope=_rope_config(meta, arch),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        sliding_windows=(None,) * layers,
        bos_token_id=meta.optional_int("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(meta),
        torch_dtype=None,  # the weights are dequantized to the engine's dtype
        # Whether the LM head (output.weight, else the tied token_embd.weight) is block-quantized:
        # the "gguf" format then keeps it in int8 groups (layers/quantization/gguf.py).
        extra={"gguf_file": str(path), "gguf_head_quantized": _head_quantized(tensors)},
    )


# GGML type ids of the float tensor types (F32, F16, F64, BF16); every other type is block-quantized.
_FLOAT_GGML_TYPES = frozenset({0, 1, 28, 30})


def _head_quantized(tensors: dict[str, Any]) -> bool:
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    return head is not None and head.ggml_type not in _FLOAT_GGML_TYPES


class _Metadata:
    """Typed access to the header's key-value fields, with errors that name the file and key."""

    def __init__(self, header: GGUFMetadata, path: str | Path) -> None:
        self.header, self.path = header, path

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.fields.get(key, default)

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise ValueError(f"{self.path} has no {key!r} in its metadata; it is not a complete GGUF model file")
        if not isinstance(value, int) or isinstance(value, ArrayLen):
            raise ValueError(f"{self.path}: {key!r} is {value!r}; pagedllm reads only one value for every layer")
        return value

    def optional_int(self, key: str) -> int | None:
        value = self.get(key)
        return None if value is None else int(value)

    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{self.path}: GGUF architecture {arch!r} is not supported; "
                f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
            )
        return str(arch)


def _vocab_size(meta: _Metadata, arch: str) -> int:
    embedding = meta.header.tensors.get("token_embd.weight")
    if embedding is not None:
        return embedding.shape[-1]  # GGUF shapes are [n_embd, n_vocab] (innermost first)
    return meta.integer(f"{arch}.vocab_size")


def _float32_repr(value: float) -> float:
    """GGUF stores float32: 1e-5 comes back as 9.99999974e-06; keep the digits float32 holds."""
    return float(f"{float(value):.7g}")


def _eos_ids(meta: _Metadata) -> tuple[int, ...]:
    ids = (meta.optional_int("tokenizer.ggml.eos_token_id"), meta.optional_int("tokenizer.ggml.eot_token_id"))
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _rope_config(meta: _Metadata, arch: str) -> RopeConfig:
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    kind = str(meta.get(f"{arch}.rope.scaling.type", "none"))
    if kind not in _ROPE_SCALING_TYPES:
        raise ValueError(
            f"{meta.path}: rope scaling type {kind!r} is not supported for GGUF; "
            f"supported: {', '.join(_ROPE_SCALING_TYPES)}"
        )
    if kind == "none":
        return RopeConfig(theta=theta)
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    return RopeConfig(
        theta=theta,
        rope_type=_ROPE_SCALING_TYPES[kind],
        factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        original_max_position_embeddings=None if original is None else int(original),
    )


def _check_rope_freqs(tensor_names: set[str], path: str | Path) -> None:
    # llama.cpp stores Llama 3.1+'s rope scaling as per-dimension factors, not as parameters.
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"{path}: tensor 'rope_freqs.weight' (Llama 3.1-style rope scaling) is not supported for GGUF yet; "
            "load the Hugging Face checkpoint of this model instead"
        )
