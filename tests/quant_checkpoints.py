"""Pre-quantized checkpoints written at test time from a tiny float model (FP8, compressed-tensors,
bitsandbytes), each with the exact float weights its codes stand for.

Every packer quantizes a float weight W [out, in] into the tensors its format stores (suffix ->
tensor, as ``<module>.<suffix>``) and returns, beside them, the weight those tensors dequantize to,
computed here in numpy from the stored codes and the documented formula (not by the code under
test). :func:`write_checkpoint` writes the quantized directory and a float "oracle" directory
holding those dequantized weights, for transformers to run.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

Packed = tuple[dict[str, torch.Tensor], np.ndarray]  # (stored tensors by suffix, dequantized W)
Packer = Callable[[torch.Tensor], Packed]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0]  # fmt: skip
FP4 = [0.0, 0.0052083334885537624, 0.6666666865348816, 1.0, 0.3333333432674408, 0.5, 0.1666666716337204, 0.25]
FP4 = FP4 + [-v for v in FP4]


def _blocks(w: np.ndarray, bn: int, bk: int) -> np.ndarray:
    """max |w| per (bn, bk) block -> [ceil(n / bn), ceil(k / bk)]."""
    n, k = w.shape
    padded = np.zeros((-(-n // bn) * bn, -(-k // bk) * bk), dtype=np.float32)
    padded[:n, :k] = np.abs(w)
    return padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk).max(axis=(1, 3))


def _expand(scale: np.ndarray, shape: tuple[int, int], bn: int, bk: int) -> np.ndarray:
    return np.repeat(np.repeat(scale, bn, axis=0), bk, axis=1)[: shape[0], : shape[1]]


def fp8(block: tuple[int, int] | str | None, scale_name: str = "weight_scale_inv") -> Packer:
    """FP8 e4m3 with a scale per block (bn, bk), per output channel ("channel") or per tensor (None)."""

    def pack(w: torch.Tensor) -> Packed:
        x = w.numpy()
        bn, bk = (1, x.shape[1]) if block == "channel" else (block or x.shape)
        scale = np.maximum(_blocks(x, bn, bk), 1e-12) / FP8_MAX
        q = torch.from_numpy(x / _expand(scale, x.shape, bn, bk)).to(torch.float8_e4m3fn)
        deq = q.float().numpy() * _expand(scale, x.shape, bn, bk)
        stored_scale = torch.from_numpy(scale) if block else torch.tensor(float(scale[0, 0]))
        return {"weight": q, scale_name: stored_scale}, deq

    return pack


def int8_channel(symmetric: bool = True, group_size: int | None = None, packed: bool = False) -> Packer:
    """compressed-tensors int8: per channel or per group, optionally asymmetric or int32-packed.
    Symmetric as the library quantizes it: scale = absmax / 127.5, codes clamped to [-128, 127],
    so a row (group) whose largest weight is negative stores -128. Packed, the asymmetric zero
    points are packed too, four per int32 down the output dim ([out / 4, groups])."""

    def pack(w: torch.Tensor) -> Packed:
        x = w.numpy()
        g = group_size or x.shape[1]
        blocks = x.reshape(x.shape[0], -1, g)
        lo, hi = blocks.min(axis=2), blocks.max(axis=2)
        if symmetric:
            scale, zp = np.maximum(np.abs(blocks).max(axis=2), 1e-12) / 127.5, np.zeros_like(lo)
        else:
            scale = np.maximum(hi - lo, 1e-12) / 255
            zp = np.round(-128 - lo / scale)
        q = np.clip(np.round(blocks / scale[..., None] + zp[..., None]), -128, 127)
        deq = ((q - zp[..., None]) * scale[..., None]).reshape(x.shape).astype(np.float32)
        q8 = torch.from_numpy(q.reshape(x.shape).astype(np.int8))
        out = {"weight_scale": torch.from_numpy(scale.astype(np.float32))}
        if not symmetric:
            zp8 = torch.from_numpy(zp.astype(np.int8))
            out["weight_zero_point"] = pack_int32(zp8.T.contiguous()).T.contiguous() if packed else zp8
        if packed:
            out["weight_packed"], out["weight_shape"] = pack_int32(q8), torch.tensor(list(x.shape))
        else:
            out["weight"] = q8
        return out, deq

    return pack


def pack_int32(q: torch.Tensor) -> torch.Tensor:
    """Four int8 values per int32, lowest byte first, each stored as q + 128 (num_bits 8)."""
    u = (q.numpy().astype(np.int64) + 128).reshape(q.shape[0], -1, 4)
    words = (u << np.array([0, 8, 16, 24])).sum(axis=2)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def bnb_int8(w: torch.Tensor) -> Packed:
    x = w.numpy()
    scb = np.maximum(np.abs(x).max(axis=1), 1e-12).astype(np.float32)
    q = np.clip(np.round(x * 127 / scb[:, None]), -127, 127).astype(np.int8)
    return {"weight": torch.from_numpy(q), "SCB": torch.from_numpy(scb)}, q * (scb[:, None] / 127)


def bnb_4bit(kind: str, nested: bool, blocksize: int = 64) -> Packer:
    """NF4 / FP4 codes (nearest table value of W / absmax per block), two per byte, high nibble
    first; ``nested``: absmax stored as uint8 codes of a 256-entry map (blocks of 256) + offset."""
    table = np.array(NF4 if kind == "nf4" else FP4, dtype=np.float32)

    def pack(w: torch.Tensor) -> Packed:
        flat = w.numpy().reshape(-1, blocksize)
        absmax = np.maximum(np.abs(flat).max(axis=1), 1e-12).astype(np.float32)
        codes = np.abs(flat[..., None] / absmax[:, None, None] - table).argmin(axis=2).reshape(-1)
        state: dict[str, Any] = {"quant_type": kind, "blocksize": blocksize, "dtype": "float32", "shape": list(w.shape)}
        out = {"weight.quant_map": torch.from_numpy(table)}
        if nested:
            absmax, extra = _nested(absmax, state)
            out.update(extra)
        else:
            out["weight.absmax"] = torch.from_numpy(absmax)
        deq = (table[codes].reshape(-1, blocksize) * absmax[:, None]).reshape(w.shape)
        out["weight"] = torch.from_numpy(((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)[:, None])
        out[f"weight.quant_state.bitsandbytes__{kind}"] = torch.tensor(
            list(json.dumps(state).encode()), dtype=torch.uint8
        )
        return out, deq

    return pack


def _nested(absmax: np.ndarray, state: dict[str, Any]) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
    """absmax -> (its dequantized values, the tensors storing it as uint8 codes)."""
    offset = float(absmax.mean())
    centred = absmax - offset
    qmap = np.linspace(-1, 1, 256, dtype=np.float32)
    blocks = -(-centred.size // 256)
    padded = np.zeros(blocks * 256, dtype=np.float32)
    padded[: centred.size] = centred
    nested_absmax = np.maximum(np.abs(padded.reshape(blocks, 256)).max(axis=1), 1e-12).astype(np.float32)
    scaled = centred / np.repeat(nested_absmax, 256)[: centred.size]
    codes = np.abs(scaled[:, None] - qmap).argmin(axis=1)
    state.update(nested_blocksize=256, nested_dtype="float32", nested_offset=offset)
    values = qmap[codes] * np.repeat(nested_absmax, 256)[: centred.size] + offset
    tensors = {
        "weight.absmax": torch.from_numpy(codes.astype(np.uint8)),
        "weight.nested_absmax": torch.from_numpy(nested_absmax),
        "weight.nested_quant_map": torch.from_numpy(qmap),
    }
    return values.astype(np.float32), tensors


def write_checkpoint(src: Path, dst: Path, quantization_config: dict[str, Any], pack: Packer) -> Path:
    """``dst`` (the quantized checkpoint) and ``dst`` + ``-oracle`` (float, the dequantized
    weights); the model's linears quantized, everything else (norms, embeddings, lm_head) as is.
    Returns the oracle directory."""
    oracle = dst.with_name(dst.name + "-oracle")
    for path in (dst, oracle):
        shutil.copytree(src, path, ignore=shutil.ignore_patterns("*.safetensors*"), dirs_exist_ok=True)
    stored, floats = {}, {}
    for name, tensor in load_file(src / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] in LINEARS and name.endswith(".weight"):
            parts, deq = pack(tensor.float())
            stored.update({f"{module}.{suffix}": t.clone().contiguous() for suffix, t in parts.items()})
            floats[name] = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))
        else:
            stored[name] = floats[name] = tensor
    save_file(stored, dst / "model.safetensors")
    save_file(floats, oracle / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return oracle
