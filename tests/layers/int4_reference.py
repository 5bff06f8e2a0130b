"""The tests' own int4 references, written from the formats' descriptions, not from pagedllm:
AWQ and GPTQ word packers, the numpy dequantize-then-matmul, and random quantized weights."""

from __future__ import annotations

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i]


def _words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values 0..15 (nibble i last-axis position i) -> int32 words (two's complement)."""
    word = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for i in range(8):
        word |= nibbles[..., i].astype(np.uint32) << np.uint32(4 * i)
    return word.view(np.int32)


def pack_awq(values: np.ndarray) -> np.ndarray:
    """[R, C] -> int32 [R, C / 8] packed along columns in AWQ's order."""
    rows, cols = values.shape
    by_column = values.reshape(rows, cols // 8, 8)
    return _words(by_column[..., list(AWQ_ORDER)])


def pack_gptq_rows(values: np.ndarray) -> np.ndarray:
    """[K, N] -> int32 [K / 8, N] packed along rows in order."""
    k, n = values.shape
    return _words(values.reshape(k // 8, 8, n).transpose(0, 2, 1))


def pack_gptq_columns(values: np.ndarray) -> np.ndarray:
    """[G, N] -> int32 [G, N / 8] packed along columns in order (GPTQ's qzeros)."""
    rows, cols = values.shape
    return _words(values.reshape(rows, cols // 8, 8))


def dequantize(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """W [N, K] = (q - zero[:, g_idx]) * scale[:, g_idx] in float32."""
    return (q.astype(np.float32) - zero[:, g_idx].astype(np.float32)) * scale[:, g_idx].astype(np.float32)


def kernel_params(
    q: np.ndarray, scale: np.ndarray, zero: np.ndarray, g_idx: np.ndarray, form: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.dtype, bool]:
    """The grouped kernels' parameter forms for ``random_int4``'s weights: (W [N, K] float32,
    scale, second tensor, the dtype to pack them in, whether the second holds offsets). ``form``:
    "float32" / "float16" zero points (W = (q - z) s; the scales are float16 values either way),
    or "offsets": float16 offsets b with W = q s + b (GGUF Q4_1's m)."""
    if form == "offsets":
        offset = (-zero.astype(np.float32) * scale).astype(np.float16).astype(np.float32)
        w = q.astype(np.float32) * scale[:, g_idx] + offset[:, g_idx]
        return w, scale, offset, torch.float16, True
    dtype = torch.float16 if form == "float16" else torch.float32
    return dequantize(q, scale, zero, g_idx), scale, zero.astype(np.float32), dtype, False


def reference_linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    y = x.astype(np.float64) @ w.astype(np.float64).T
    return y if bias is None else y + bias


def random_int4(n: int, k: int, group: int, rng: np.random.Generator, desc_act: bool = False):
    """Random (q [N, K], scale [N, K / G] (fp16-exact), zero [N, K / G], g_idx [K]) with weights
    of about unit fan-in variance; ``desc_act``: groups assigned to shuffled inputs."""
    groups = k // group
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    zero = rng.integers(0, 16, (n, groups), dtype=np.uint8)
    scale = (rng.uniform(0.5, 1.5, (n, groups)) / (6.0 * np.sqrt(k))).astype(np.float16).astype(np.float32)
    g_idx = np.arange(k) // group
    if desc_act:
        g_idx = g_idx[rng.permutation(k)]
    return q, scale, zero, g_idx.astype(np.int32)


def as_tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))
