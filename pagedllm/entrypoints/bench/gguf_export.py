"""Write a Llama-family HF model (random or loaded weights) as a GGUF file for llama.cpp: float32,
or its matrices quantized by ``gguf.quants`` (Q8_0 / Q4_0 for the quantized baselines and the GGUF
loader's tests).

A minimal version of llama.cpp's ``convert_hf_to_gguf.py`` for the llama architecture: the
``llama.*`` hyper-parameters, tensors under llama.cpp's names (q/k rows permuted from HF's
rotate-half RoPE layout to llama.cpp's interleaved one, so the GGUF model computes the same
function as the HF one), and a dummy SentencePiece-style vocab of the model's size: the
benchmarks feed token ids and never tokenize text.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

SAME = "same"  # write_gguf's head_quant: the LM head matrix takes the others' type

# HF (per layer, after "model.layers.N.") -> GGUF (after "blk.N.")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's [first half | second half] rotary row order -> llama.cpp's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(
    state: dict[str, Any], config: dict[str, Any], permute: bool = True
) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every weight llama.cpp needs (tied LM heads are left out:
    llama.cpp reuses token_embd when output.weight is absent). ``permute``: llama's q/k row
    order (llama.cpp permutes only the llama architecture)."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    for name, tensor in state.items():
        array = tensor.detach().float().cpu().numpy()
        if name in _TOP_NAMES:
            if name == "lm_head.weight" and config.get("tie_word_embeddings"):
                continue
            yield _TOP_NAMES[name], array
            continue
        parts = name.split(".")  # model.layers.N.rest
        if parts[:2] != ["model", "layers"] or ".".join(parts[3:]) not in _LAYER_NAMES:
            raise ValueError(f"no GGUF name for the HF tensor {name!r}: only Llama-family models convert")
        rest = ".".join(parts[3:])
        if permute and rest.startswith("self_attn.q_proj"):
            array = permute_rope(array, heads)
        elif permute and rest.startswith("self_attn.k_proj"):
            array = permute_rope(array, kv_heads)
        yield f"blk.{parts[2]}.{_LAYER_NAMES[rest]}", array


def _add_hparams(writer: Any, config: dict[str, Any], quant: str | None) -> None:
    import gguf

    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer.add_name("pagedllm-bench")
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{quant}"] if quant else gguf.LlamaFileType.ALL_F32)


def _add_dummy_vocab(writer: Any, config: dict[str, Any]) -> None:
    """``vocab_size`` tokens: BOS/EOS as control tokens, the 256 byte tokens, then ``t<id>``."""
    import gguf

    vocab = config["vocab_size"]
    bos = _token_id(config.get("bos_token_id"), 0)
    eos = _token_id(config.get("eos_token_id"), 1)
    tokens, types = [], []
    next_byte = 0
    for i in range(vocab):
        if i in (bos, eos):
            tokens.append("<s>" if i == bos else "</s>")
            types.append(gguf.TokenType.CONTROL)
        elif next_byte < 256:
            tokens.append(f"<0x{next_byte:02X}>")
            types.append(gguf.TokenType.BYTE)
            next_byte += 1
        else:
            tokens.append(f"t{i}")
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types(types)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)


def _token_id(value: Any, default: int) -> int:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else default


def write_gguf(
    state: dict[str, Any],
    config: dict[str, Any],
    path: Path,
    quant: str | None = None,
    arch: str = "llama",
    head_quant: str | None = SAME,
    overrides: dict[str, str | None] | None = None,
) -> Path:
    """Write ``state`` (an HF Llama or Qwen2 state dict) with ``config`` (its config.json dict) to
    ``path``; ``quant`` (a GGML type name such as "Q8_0" or "Q4_0") quantizes every matrix whose
    rows fit its blocks, the rest stays float32. ``head_quant``: the type of the LM head matrix
    (``output.weight``, or ``token_embd.weight`` when the embeddings are tied): the same as the
    others (default), None for float32, or a GGML type name (llama.cpp's ``llama-quantize`` keeps
    it at Q8_0 or Q6_K in its 4-bit types). ``overrides``: a type by tensor kind (the name's part
    before ``.weight``, e.g. ``{"attn_v": "Q5_1", "ffn_down": "Q5_0"}``, as llama.cpp's mixed
    ``_M`` types keep those in more bits)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    _add_hparams(writer, config, quant)
    _add_dummy_vocab(writer, config)
    untied = "lm_head.weight" in state and not config.get("tie_word_embeddings")
    head = "output.weight" if untied else "token_embd.weight"
    for name, array in gguf_tensors(state, config, permute=arch == "llama"):
        tensor_quant = quant if head_quant == SAME or name != head else head_quant
        kind = name.removesuffix(".weight").rsplit(".", 1)[-1]
        if overrides and kind in overrides and name != head:
            tensor_quant = overrides[kind]
        _add_tensor(writer, name, np.ascontiguousarray(array, dtype=np.float32), tensor_quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensor(writer: Any, name: str, array: np.ndarray, quant: str | None) -> None:
    import gguf
    from gguf.constants import GGML_QUANT_SIZES

    qtype = gguf.GGMLQuantizationType[quant] if quant else None
    if qtype is None or array.ndim != 2 or array.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        writer.add_tensor(name, array)
        return
    blocks = quantize_iq4(array, quant) if quant in IQ4_KVALUES_TYPES else gguf.quants.quantize(array, qtype)
    writer.add_tensor(name, blocks, raw_dtype=qtype)


IQ4_KVALUES_TYPES = ("IQ4_NL", "IQ4_XS")
_KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def quantize_iq4(array: np.ndarray, quant: str) -> np.ndarray:
    """[rows, K] float32 -> IQ4_NL or IQ4_XS blocks (uint8 [rows, row bytes]), which gguf-py
    cannot write: per 32 values a scale that maps the one of largest magnitude onto -127 (the
    table's end) and each value's nearest table entry; IQ4_XS stores each 32's scale as a 6-bit
    multiple (ls - 32) of its 256-block's d. (llama.cpp searches the scale further; the layout is its.)"""
    rows, k = array.shape
    runs = array.reshape(-1, 32).astype(np.float32)
    extreme = runs[np.arange(len(runs)), np.abs(runs).argmax(axis=1)]
    scale = (extreme / _KVALUES[0]).astype(np.float32)
    if quant == "IQ4_NL":
        d = scale.astype(np.float16)
        blocks = [d.view(np.uint8).reshape(-1, 2), _iq4_nibbles(runs, d.astype(np.float32))]
        return np.concatenate(blocks, axis=1).reshape(rows, -1)
    per_block = scale.reshape(-1, 8)
    d = (np.abs(per_block).max(axis=1) / 31).astype(np.float16)
    safe = np.where(d == 0, np.float16(1), d).astype(np.float32)
    ls = (np.clip(np.round(per_block / safe[:, None]), -32, 31) + 32).astype(np.uint8)  # [B, 8]
    nibbles = _iq4_nibbles(runs, (d.astype(np.float32)[:, None] * (ls.astype(np.float32) - 32)).reshape(-1))
    high = ((ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    low = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
    blocks = [d.view(np.uint8).reshape(-1, 2), high.view(np.uint8).reshape(-1, 2), low, nibbles.reshape(-1, 128)]
    return np.concatenate(blocks, axis=1).reshape(rows, -1)


def _iq4_nibbles(runs: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Each run of 32's nearest table codes under its scale, as 16 bytes (code i | code i + 16 << 4)."""
    safe = np.where(scale == 0, 1.0, scale).astype(np.float32)[:, None]
    codes = np.abs(runs[:, :, None] / safe[:, :, None] - _KVALUES).argmin(axis=2).astype(np.uint8)
    return codes[:, :16] | (codes[:, 16:] << 4)
