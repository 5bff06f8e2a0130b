"""Weights from a GGUF file: each tensor dequantized on its own by ``gguf.quants`` (the file stays
memory-mapped; its tensor table comes from ``gguf_metadata``, which a test checks against
``gguf.GGUFReader``), renamed to the Hugging Face name our models load, and, for Llama, un-permuted.

llama.cpp's converter reorders the rows of Llama's Q and K projections so that each head's
rotary pairs sit interleaved (its rope layout); ours (and Hugging Face's) rotate the two halves
of a head, so the permutation is undone here, as transformers' GGUF loader does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import numpy as np
import torch

from pagedllm.gguf_config import read_metadata
from pagedllm.gguf_metadata import GGUFMetadata, TensorInfo
from pagedllm.layers.quantization.gguf import block_parts
from pagedllm.model_arch import ModelArchConfig

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")
# Architectures whose Q/K rows llama.cpp's converter permutes.
_PERMUTED_ARCHS = {"llama"}


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; names we don't
    know come back unchanged (the loader then reports them as unexpected)."""
    if (m := _BLOCK_RE.fullmatch(gguf_name)) and m[2] in _BLOCK_NAMES:
        return f"model.layers.{m[1]}.{_BLOCK_NAMES[m[2]]}.{m[3]}"
    if (m := _GLOBAL_RE.fullmatch(gguf_name)) and m[1] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m[1]]}.{m[2]}"
    return gguf_name


def iterate_gguf(
    path: str | Path,
    arch: ModelArchConfig,
    keep: Callable[[str], bool] | None = None,
    header: GGUFMetadata | None = None,
    keep_blocks: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of the file (whose name ``keep``
    accepts), one at a time from the memory-mapped file. The header (``header`` if the caller
    has read it) is read, and a bad file refused, now, before the caller allocates the model.
    ``keep_blocks``: a linear's (and the LM head's, also when it is the embedding's table) Q4_0 /
    Q4_1 / Q4_K weight comes as its int4 parts instead
    (``layers/quantization/gguf.py``: ``...q_proj.gguf_q``, ``.gguf_scale``, ``.gguf_zero``), a
    Q8_0 one as its int8 values and block scales (``.gguf_q8``, ``.gguf_q8_scale``), a Q2_K /
    Q3_K / Q5_0 / Q5_1 / Q5_K / Q6_K one as int8 groups of 16 (``.gguf_qz``, ``.gguf_qz_scale``, ``.gguf_qz_zero``),
    and an IQ4_NL / IQ4_XS one as its codes and scales (``.gguf_iq4``, ``.gguf_iq4_scale``)."""
    return _dequantized(header or read_metadata(path), path, arch, keep, keep_blocks)


def _dequantized(
    header: GGUFMetadata,
    path: str | Path,
    arch: ModelArchConfig,
    keep: Callable[[str], bool] | None,
    keep_blocks: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.constants import GGMLQuantizationType

    file = np.memmap(path, dtype=np.uint8, mode="r")
    tied = "output.weight" not in header.tensors  # the head is the embedding's table
    for name, info in header.tensors.items():
        hf_name = hf_tensor_name(name)
        qtype = GGMLQuantizationType(info.ggml_type).name
        raw = partial(_rows, name, info, file[header.data_offset :], path)
        if keep_blocks and tied and name == "token_embd.weight" and (keep is None or keep("lm_head.weight")):
            for suffix, part in block_parts("lm_head.weight", qtype, raw) or []:  # the head's own copy
                yield "lm_head." + suffix, torch.from_numpy(part)
        if keep is not None and not keep(hf_name):
            continue  # never dequantized: another pipeline stage's tensor
        parts = block_parts(hf_name, qtype, raw) if keep_blocks else None
        if parts is not None:
            for suffix, part in parts:
                yield hf_name.removesuffix("weight") + suffix, torch.from_numpy(unpermute_qk(name, part, arch))
            continue
        weights = unpermute_qk(name, dequantize(name, info, file[header.data_offset :], path), arch)
        yield hf_name, torch.from_numpy(weights)


def dequantize(name: str, info: TensorInfo, data: np.ndarray, path: str | Path) -> np.ndarray:
    """Tensor ``name`` of the data section ``data`` as a writable float32 array in the Hugging Face
    layout ([out, in] for a matrix): its rows' bytes handed to ``gguf.quants.dequantize``."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    qtype = GGMLQuantizationType(info.ggml_type)  # known: the header check looked it up
    shape = tuple(reversed(info.shape))  # GGUF lists dimensions innermost first
    raw = _rows(name, info, data, path)
    try:
        values = gguf_dequantize(raw, qtype)
    except (NotImplementedError, ValueError) as exc:
        raise ValueError(
            f"{path}: cannot dequantize tensor {name!r} of type {qtype.name} ({exc}); "
            f"supported types: {', '.join(supported_tensor_types())}"
        ) from exc
    values = values.reshape(shape)
    return values if values.flags.writeable and values.dtype == np.float32 else values.astype(np.float32)


def _rows(name: str, info: TensorInfo, data: np.ndarray, path: str | Path) -> np.ndarray:
    """Tensor ``name``'s bytes as uint8 [rows, bytes per row] (a view of the memory-mapped file)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(info.ggml_type)
    shape = tuple(reversed(info.shape))
    block, type_size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"{path}: tensor {name!r} has rows of {shape[-1]} values, not whole {qtype.name} blocks")
    rows, row_bytes = math.prod(shape[:-1]), shape[-1] // block * type_size
    return data[info.offset : info.offset + rows * row_bytes].reshape(rows, row_bytes)


def supported_tensor_types() -> list[str]:
    """The GGML tensor types ``gguf.quants.dequantize`` decodes (floats and quantized blocks)."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    floats = [GGMLQuantizationType.F32, GGMLQuantizationType.F16]
    blocks = getattr(gguf.quants, "_type_traits", {})  # private: the types with a numpy decoder
    return [t.name for t in (*floats, *blocks)]


def unpermute_qk(name: str, weights: np.ndarray, arch: ModelArchConfig) -> np.ndarray:
    """Undo llama.cpp's rope row permutation of Llama's ``attn_q`` / ``attn_k`` (weights and biases)."""
    if arch.model_type not in _PERMUTED_ARCHS:
        return weights
    if ".attn_q." in name:
        return _reverse_permute(weights, arch.num_attention_heads)
    if ".attn_k." in name:
        return _reverse_permute(weights, arch.num_key_value_heads)
    return weights


def _reverse_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp: w.reshape(heads, 2, rows // heads // 2, ...).swapaxes(1, 2); this is its inverse.
    half = weights.shape[0] // num_heads // 2
    rows = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(rows.swapaxes(1, 2).reshape(weights.shape))
