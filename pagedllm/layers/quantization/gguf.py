"""GGUF's 4-bit linears stay 4-bit: Q4_0, Q4_1 and Q4_K blocks repacked onto the int4 kernel.

Every one of these types is, per run of 32 inputs of a row, an unsigned nibble q times a scale
plus an offset, which is the int4 method's W = (q - z) * s with G = 32:
  Q4_0 (18-byte blocks of 32): d, 16 bytes of nibbles;        W = d (q - 8):   s = d, z = 8
  Q4_1 (20-byte blocks of 32): d, m, 16 bytes of nibbles;     W = d q + m:     s = d, z = -m / d
  Q4_K (144-byte blocks of 256): d, dmin, 6-bit (sc, mn) per 32, 128 bytes of nibbles;
                                                              W = d sc q - dmin mn: s = d sc, z = dmin mn / s
The nibbles are the file's; only the zero point of Q4_1 / Q4_K is a division, so a weight the
kernel sees differs from llama.cpp's dequantized one by float rounding (a few ulp). A group whose
scale is 0 is constant (the offset alone): it is stored as q = 1, s = offset, z = 0, exactly.
The offsets stream too (W = q s + b; Q4_1: b = m, the file's float16): a Q4_1 layer is held with
them in place of its zero points (``Int4KernelMethod.finish_int4``), exactly as the file stores it
and in float16, 5 bits a weight instead of 6 with float32 zero points.

Q8_0 linears (W = d q, q int8 per 32 inputs) stay 8-bit the same way: their int8 values and
block scales (``q8_to_int8``, exact) on the group-wise int8 op (``int8_groups.GroupedInt8Method``).
The 2-, 3-, 5- and 6-bit types stay 8-bit too, as int8 groups of 16 with a zero point, W = (q - z) * s
(``blocks_to_int8``; 12 bits a weight instead of float32's 32):
  Q6_K (210-byte blocks of 256): 6-bit q - 32, an int8 scale per 16, d:  s = d sc, z = 0 (exact)
  Q5_0 (22-byte blocks of 32): d, 5-bit q:                            W = d (q - 16): s = d, z = 0
  Q5_1 (24-byte blocks of 32): d, m, 5-bit q:                         W = d q + m
  Q5_K (176-byte blocks of 256): Q4_K's with a fifth bit per value:  W = d sc q - dmin mn
  Q3_K (110-byte blocks of 256): q in -4..3, a 6-bit scale - 32 per 16, d: s = d sc, z = 0 (exact)
  Q2_K (84-byte blocks of 256): q in 0..3, 4-bit sc and mn per 16, d, dmin: W = d sc q - dmin mn
IQ4_NL and IQ4_XS stay 4-bit on the int4 kernel with their 16-value table (``iq4_to_codes``,
op ``packed_linear_int4_table``, W = table[q] * s with the table llama.cpp's int8 ``kvalues``):
  IQ4_NL (18-byte blocks of 32): d, 16 bytes of nibbles:          s = d
  IQ4_XS (136-byte blocks of 256): d, a 6-bit scale ls per 32, 128 bytes of nibbles: s = d (ls - 32)
exactly the file's weights (the table values are integers, the scales as gguf-py multiplies them);
in a layer that mixes them with other block types their values (int8 already) join the int8
groups below. And so does a fused projection whose parts mix block types (Q4_K_M files keep ``attn_v`` and
some ``ffn_down`` in Q6_K): each part's values and scales as its type has them (a 32-input
group's scale and zero twice). A layer with a float part (F32, F16, or a type without a kernel
form) loads dequantized to float32, as without this method. So each linear registers every form,
filled lazily (an unused form never allocates), and ``process_weights_after_loading`` keeps one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from pagedllm.layers.quantization import int8_groups
from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig, WeightLoader, set_weight_attrs
from pagedllm.layers.quantization.int4 import Int4KernelMethod
from pagedllm.layers.quantization.int8_groups import GroupedInt8HeadMethod
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod

logger = logging.getLogger(__name__)

GROUP = 32
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# The checkpoint names a 4-bit linear streams as (``models/gguf_loader``), after ``.weight``'s stem.
Q4_SUFFIXES = ("gguf_q", "gguf_scale", "gguf_zero", "gguf_offset")
# Q8_0 linears stream as their int8 values and block scales and stay int8 (``int8_groups``).
Q8_SUFFIXES = ("gguf_q8", "gguf_q8_scale")
# The 5- and 6-bit types stream as int8 groups of 16 with a zero point (``blocks_to_int8``).
INT8_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K")
INT8_SUFFIXES = ("gguf_qz", "gguf_qz_scale", "gguf_qz_zero")
INT8_GROUP = 16
# IQ4_NL / IQ4_XS stream as their codes and a scale per 32 inputs, and run with IQ4_TABLE.
IQ4_TYPES = ("IQ4_NL", "IQ4_XS")
IQ4_SUFFIXES = ("gguf_iq4", "gguf_iq4_scale")
IQ4_TABLE = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # llama.cpp's kvalues_iq4nl
_IQ4 = torch.tensor(IQ4_TABLE, dtype=torch.float32)


def q4_to_int4(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``raw`` uint8 [rows, row_bytes] of one of ``Q4_TYPES`` -> (q uint8 [rows, K] in 0..15,
    scale, zero and offset float32 [rows, K / 32]) with W = (q - zero) * scale = q * scale + offset
    (the offset as the file has it, the zero point a division)."""
    rows = raw.shape[0]
    if qtype == "Q4_K":
        q, scale, offset = _q4_k(raw.reshape(-1, 144))
    else:
        blocks = raw.reshape(-1, 18 if qtype == "Q4_0" else 20)
        q = _nibbles(blocks[:, -16:], 16)
        scale = _f16(blocks[:, 0:2])
        offset = 8.0 * scale if qtype == "Q4_0" else -_f16(blocks[:, 2:4])
    q, scale, zero, b = _zero_points(q.reshape(-1, GROUP), scale.reshape(-1), offset.reshape(-1))
    return q.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1), b.reshape(rows, -1)


def q8_to_int8(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``raw`` uint8 [rows, row_bytes] of Q8_0 (34-byte blocks of 32: a float16 d, 32 int8 q;
    W = d q) -> (q int8 [rows, K], scale float32 [rows, K / 32]), exactly the file's values."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, 34)
    return blocks[:, 2:].view(np.int8).reshape(rows, -1).copy(), _f16(blocks[:, 0:2]).reshape(rows, -1)


def blocks_to_int8(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``raw`` uint8 [rows, row_bytes] of one of ``INT8_TYPES`` -> (q int8 [rows, K], scale and
    zero float32 [rows, K / 16]) with W = (q - zero) * scale: the file's integers; the scales as
    gguf-py multiplies them (a zero point, where the type has an offset, is offset / scale, as for
    the 4-bit types). (A layer's 4-bit and Q8_0 parts join this form in ``GGUFLinearMethod``.)"""
    rows = raw.shape[0]
    if qtype == "Q6_K":
        blocks = np.ascontiguousarray(raw).reshape(-1, 210)
        q = (_q6_k_values(blocks) - 32).astype(np.int8)
        scale = _f16(blocks[:, 208:210])[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
        return q.reshape(rows, -1), scale.reshape(rows, -1), np.zeros((rows, scale.size // rows), dtype=np.float32)
    if qtype == "Q3_K":  # 110-byte blocks of 256: W = d (sc - 32) q, q in -4..3, a 6-bit sc per 16
        blocks = np.ascontiguousarray(raw).reshape(-1, 110)
        q, sc = _q3_k_values(blocks)
        scale = _f16(blocks[:, 108:110])[:, None] * sc.astype(np.float32)
        return q.reshape(rows, -1), scale.reshape(rows, -1), np.zeros((rows, scale.size // rows), dtype=np.float32)
    if qtype == "Q2_K":  # 84-byte blocks of 256: W = d sc q - dmin mn, q in 0..3, 4-bit sc and mn per 16
        blocks = np.ascontiguousarray(raw).reshape(-1, 84)
        d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
        sc = (blocks[:, 0:16] & 15).astype(np.float32)
        q2 = _crumbs(blocks[:, 16:80], 32)
        scale, offset = d[:, None] * sc, dmin[:, None] * (blocks[:, 0:16] >> 4).astype(np.float32)
        q, scale, zero, _ = _zero_points(q2.reshape(-1, INT8_GROUP), scale.reshape(-1), offset.reshape(-1))
        return q.astype(np.int8).reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1)
    if qtype == "Q5_0":
        blocks = np.ascontiguousarray(raw).reshape(-1, 22)
        q = (_q5_values(blocks[:, 2:6], blocks[:, 6:22]).astype(np.int16) - 16).astype(np.int8)
        d = _f16(blocks[:, 0:2])
        return q.reshape(rows, -1), _by16(d.reshape(rows, -1)), np.zeros((rows, q.size // rows // 16), np.float32)
    if qtype == "Q5_1":
        blocks = np.ascontiguousarray(raw).reshape(-1, 24)
        q5 = _q5_values(blocks[:, 4:8], blocks[:, 8:24])
        q, scale, zero, _ = _zero_points(q5, _f16(blocks[:, 0:2]), -_f16(blocks[:, 2:4]))
    elif qtype == "Q5_K":
        from gguf.quants import Q4_K

        blocks = np.ascontiguousarray(raw).reshape(-1, 176)
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        q5 = _q5_k_values(blocks[:, 16:48], blocks[:, 48:176]).reshape(-1, GROUP)
        scale = d[:, None] * sc.astype(np.float32)
        q, scale, zero, _ = _zero_points(q5, scale.reshape(-1), (dmin[:, None] * mn.astype(np.float32)).reshape(-1))
    else:
        raise ValueError(f"no int8 form for GGUF type {qtype}")
    return q.astype(np.int8).reshape(rows, -1), _by16(scale.reshape(rows, -1)), _by16(zero.reshape(rows, -1))


def iq4_to_codes(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``raw`` uint8 [rows, row_bytes] of IQ4_NL or IQ4_XS -> (codes uint8 [rows, K] in 0..15,
    scale float32 [rows, K / 32]) with W = IQ4_TABLE[code] * scale: the file's nibbles (per 16
    bytes the low nibbles, then the high), its scales as gguf-py computes them."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw)
    if qtype == "IQ4_NL":
        blocks = blocks.reshape(-1, 18)
        return _nibbles(blocks[:, 2:], 16).reshape(rows, -1), _f16(blocks[:, 0:2]).reshape(rows, -1)
    if qtype != "IQ4_XS":
        raise ValueError(f"no 4-bit table form for GGUF type {qtype}")
    blocks = blocks.reshape(-1, 136)
    d = _f16(blocks[:, 0:2])
    high = (blocks[:, 2:4].view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # [B, 8]
    low = (blocks[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)) & 15  # [B, 4, 2]: sub-block 2 i + j
    ls = low.reshape(-1, 8).astype(np.int16) | (high.astype(np.int16) << 4)
    scale = d[:, None] * (ls - 32).astype(np.float32)
    return _nibbles(blocks[:, 8:], 16).reshape(rows, -1), scale.reshape(rows, -1)


def _by16(per32: np.ndarray) -> np.ndarray:
    """[rows, K / 32] -> [rows, K / 16]: a 32-input group's value for each of its halves."""
    return np.repeat(per32, 2, axis=1)


def _q6_k_values(blocks: np.ndarray) -> np.ndarray:
    """Q6_K blocks [B, 210] -> their unsigned 6-bit values [B, 256]: per half of 128, the low
    nibbles of 64 bytes then their high nibbles, each with 2 bits of a 32-byte run (bits 0-1 for
    the first 32 values, 2-3, 4-5, 6-7 for the next)."""
    low = _nibbles(blocks[:, 0:128], 64)
    return low | (_crumbs(blocks[:, 128:192], 32) << np.uint8(4))


def _q3_k_values(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q3_K blocks [B, 110] -> (values int8 [B, 256] in -4..3, scales - 32 as int8 [B, 16]): per
    half of 128, 2 bits of a 32-byte run at shifts 0, 2, 4, 6, with a high bit from the 32-byte
    mask (bit j for the j-th run of 32) that, clear, subtracts 4; the 6-bit scales as 12 bytes
    (low nibbles of bytes 0-7, then 2 bits each from bytes 8-11)."""
    high = (blocks[:, 0:32].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = _crumbs(blocks[:, 32:96], 32).astype(np.int8) - ((high.reshape(-1, 256) ^ 1) << 2).astype(np.int8)
    sc = _nibbles(blocks[:, 96:104], 8) | (_crumbs(blocks[:, 104:108], 4) << np.uint8(4))
    return q, sc.astype(np.int8) - np.int8(32)


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 blocks' 32-bit high bits [B, 4] and nibbles [B, 16] -> values [B, 32]: value j
    is nibble j (low nibbles first) with bit j of the little-endian word as its fifth bit."""
    bits = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
    return _nibbles(qs, 16) | ((bits & 1).astype(np.uint8) << np.uint8(4))


def _q5_k_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_K's high bits [B, 32] and nibbles [B, 128] -> values [B, 256]: group g of 32 (the low
    nibbles of a 32-byte run, then its high ones) takes bit g of each of the 32 high-bit bytes."""
    high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return _nibbles(qs, 32) | (high.reshape(-1, 256) << np.uint8(4))


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(two_bytes).view(np.float16).astype(np.float32).reshape(-1)


def _crumbs(packed: np.ndarray, run: int) -> np.ndarray:
    """Bytes [B, n] -> 2-bit values [B, 4 n]: each run of ``run`` bytes gives its bits 0-1, then
    2-3, 4-5 and 6-7 (the K-quants' low bits)."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((packed.reshape(packed.shape[0], -1, 1, run) >> shifts) & np.uint8(3)).reshape(packed.shape[0], -1)


def _nibbles(packed: np.ndarray, run: int) -> np.ndarray:
    """Bytes [B, n] -> values [B, 2 n]: each run of ``run`` bytes gives its low nibbles, then its high."""
    grouped = packed.reshape(packed.shape[0], -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (grouped & np.uint8(15)).reshape(packed.shape[0], -1)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from gguf.quants import Q4_K

    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    scale = d[:, None] * sc.astype(np.float32)  # [B, 8]: one per 32 inputs, as llama.cpp multiplies
    offset = dmin[:, None] * mn.astype(np.float32)  # W = scale q - offset
    return _nibbles(blocks[:, 16:], 32), scale, offset


def _zero_points(
    q: np.ndarray, scale: np.ndarray, offset: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Groups W = scale q - offset -> (q, s, z, b) with W = (q - z) s = q s + b; constant groups
    (scale 0) exact: q = 1, s = -offset, z = b = 0."""
    constant = scale == 0
    safe = np.where(constant, 1.0, scale).astype(np.float32)
    zero = np.where(constant, 0.0, offset / safe).astype(np.float32)
    q = np.where(constant[:, None], np.uint8(1), q).astype(np.uint8)
    b = np.where(constant, 0.0, -offset).astype(np.float32)
    return q, np.where(constant, -offset, scale).astype(np.float32), zero, b


@lru_cache(maxsize=1)
def _warn_iq4_float_activations() -> None:  # once a process, not once a linear
    logger.warning("w4a8: the GGUF file's IQ4_NL / IQ4_XS linears run their code table with float activations")


def _lazy_param(
    layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, loader: WeightLoader, seen: set[Any]
) -> None:
    """An empty parameter that takes its full size on its first checkpoint tensor (recorded in ``seen``)."""
    param = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def load(param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        if param.numel() == 0:  # zeros: an LM head's padding rows past the vocabulary get no tensor
            param.data = torch.zeros(shape, dtype=dtype)
        loader(param, tensor, shard_id)
        seen.add(shard_id)

    # load_optional: either this form or the other fills a shard, which process_weights_after_loading checks.
    set_weight_attrs(param, output_dim=0, input_dim=1, weight_loader=load, load_optional=True)
    layer.register_parameter(name, param)


class GGUFLinearMethod(Int4KernelMethod):
    """A linear of a GGUF file: int4 when every part is a 4-bit block type, the int4 table op when
    every part is IQ4_NL / IQ4_XS, int8 groups of 32 (``int8_groups.GroupedInt8Method``) when
    every part is Q8_0, int8 groups of 16 with zero points for any other mix of block types,
    float32 when a part is float."""

    format_name = "gguf"

    def __init__(self, int8_activations: bool = False) -> None:
        super().__init__()
        self.int8_activations = int8_activations  # w4a8 on a GGUF file: the blocks with int8 activations
        self.float_parts: set[Any] = set()
        self.q4_parts: set[Any] = set()
        self.q8_parts: set[Any] = set()
        self.int8_parts: set[Any] = set()
        self.iq4_parts: set[Any] = set()
        self.converted = False

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        n = sum(output_sizes)
        self.output_sizes, self.params_dtype = output_sizes, params_dtype
        _lazy_param(layer, "weight", (n, input_size), params_dtype, weight_loader, self.float_parts)
        if input_size % GROUP == 0:  # else no 4-bit block fits a row (the float form still loads)
            q_shapes = ((n, input_size), *[(n, input_size // GROUP)] * 3)
            for name, shape, dtype in zip(Q4_SUFFIXES, q_shapes, (torch.uint8, *[torch.float32] * 3)):
                _lazy_param(layer, name, shape, dtype, weight_loader, self.q4_parts)
            for name, shape, dtype in zip(Q8_SUFFIXES, q_shapes, (torch.int8, torch.float32)):
                _lazy_param(layer, name, shape, dtype, weight_loader, self.q8_parts)
            by16 = (n, input_size // INT8_GROUP)
            for name, shape, dtype in zip(INT8_SUFFIXES, (q_shapes[0], by16, by16), (torch.int8, *[torch.float32] * 2)):
                _lazy_param(layer, name, shape, dtype, weight_loader, self.int8_parts)
            for name, shape, dtype in zip(IQ4_SUFFIXES, q_shapes, (torch.uint8, torch.float32)):
                _lazy_param(layer, name, shape, dtype, weight_loader, self.iq4_parts)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.converted:
            return
        parts = list(range(len(self.output_sizes))) if len(self.output_sizes) > 1 else [None]
        blocks = self.q4_parts | self.q8_parts | self.int8_parts | self.iq4_parts
        missing = [p for p in parts if p not in self.float_parts | blocks]
        if missing:
            raise ValueError(
                f"the GGUF file has no tensor for part(s) {missing} of a linear layer with outputs "
                f"{self.output_sizes}; the file does not match the model's shapes"
            )
        forms = {
            kind: [getattr(layer, name).data for name in suffixes]
            for kind, suffixes, filled in (
                ("q4", Q4_SUFFIXES, self.q4_parts),
                ("q8", Q8_SUFFIXES, self.q8_parts),
                ("int8", INT8_SUFFIXES, self.int8_parts),
                ("iq4", IQ4_SUFFIXES, self.iq4_parts),
            )
            if filled
        }
        for name in (*Q4_SUFFIXES, *Q8_SUFFIXES, *INT8_SUFFIXES, *IQ4_SUFFIXES):
            if hasattr(layer, name):
                delattr(layer, name)
        self.converted = True
        if not self.float_parts and set(forms) == {"q4"}:
            q, scale, zero, offset = forms["q4"]
            self.finish_int4(layer, q, scale, zero, None, offset=offset)
            return
        if not self.float_parts and set(forms) == {"iq4"}:
            codes, scale = forms["iq4"]
            if self.finish_int4_table(layer, codes, scale, _IQ4):
                if self.int8_activations:
                    _warn_iq4_float_activations()
                return
        method: LinearMethodBase
        if forms and not self.float_parts and int8_groups.can_store(next(iter(forms.values()))[0]):
            method = int8_groups.GroupedInt8Method()
            if set(forms) == {"q8"}:  # Q8_0 throughout: its own groups of 32, no zero point
                method.store(layer, *forms["q8"])
            else:
                q, scale, zero = self._int8_form(forms)
                method.store(layer, q, scale, zero if bool(zero.any()) else None)  # None: symmetric types only
            cast(Any, layer).quant_method = method
        else:  # a float part (or no kernel for the blocks): all float
            if forms:
                self._fill_float(layer, int8_groups.dequantize_groups(*self._int8_form(forms)), blocks)
            method = UnquantizedLinearMethod()
            cast(Any, layer).quant_method = method
            method.process_weights_after_loading(layer)
        if self.int8_activations:
            logger.warning(
                "w4a8: a linear with outputs %s is not stored in a 4-bit block type (Q4_0 / Q4_1 / Q4_K) "
                "throughout in the GGUF file; it runs as %s with float activations",
                self.output_sizes,
                "int8 groups" if isinstance(method, int8_groups.GroupedInt8Method) else "float32",
            )

    def _int8_form(self, forms: dict[str, list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block parts as one int8 layer of groups of 16 with zero points (q, scale, zero; a
        float part's rows stay 0): 4-bit values as they are, a 32-input group's scale and zero twice."""
        rows, k = next(iter(forms.values()))[0].shape
        q = torch.zeros(rows, k, dtype=torch.int8)
        scale, zero = (torch.zeros(rows, k // INT8_GROUP) for _ in range(2))
        kinds = (("q4", self.q4_parts), ("q8", self.q8_parts), ("int8", self.int8_parts), ("iq4", self.iq4_parts))
        for kind, parts in kinds:
            if kind not in forms:
                continue
            values = forms[kind]
            if kind == "iq4":  # the table's values are int8 already: (codes, scale) -> (values, scale, 0)
                values = [_IQ4.to(torch.int8)[values[0].long()], values[1], torch.zeros_like(values[1])]
            kind_zero = values[2] if kind != "q8" else torch.zeros_like(values[1])
            repeat = 1 if kind == "int8" else GROUP // INT8_GROUP  # a group of 32's scale for each half
            for start, end in self._rows_of(parts):
                q[start:end] = values[0][start:end].to(torch.int8)
                scale[start:end] = values[1][start:end].repeat_interleave(repeat, dim=1)
                zero[start:end] = kind_zero[start:end].repeat_interleave(repeat, dim=1)
        return q, scale, zero

    def _rows_of(self, parts: set[Any]) -> list[tuple[int, int]]:
        """The output rows [start, end) of each of ``parts`` (a block kind's)."""
        spans, start = [], 0
        for part, size in enumerate(self.output_sizes):
            if part in parts or (part == 0 and None in parts):
                spans.append((start, start + size))
            start += size
        return spans

    def _fill_float(self, layer: nn.Module, w: torch.Tensor, parts: set[Any]) -> None:
        """The rows of ``parts`` (the block kinds') of the float weight from their dequantization ``w``."""
        weight = cast(nn.Parameter, layer.weight)
        if weight.numel() == 0:
            weight.data = torch.empty(w.shape, dtype=self.params_dtype)
        for start, end in self._rows_of(parts):
            weight.data[start:end] = w[start:end]


class GGUFHeadMethod(GGUFLinearMethod):
    """A GGUF file's LM head stored block-quantized (``output``, or ``token_embd`` when the model
    ties them): from the file's blocks as a linear's are (Q4_0 / Q4_1 / Q4_K on the int4 kernel,
    IQ4_NL / IQ4_XS on its table op, Q8_0 in int8 groups of 32, Q2_K / Q3_K / Q5_* / Q6_K in int8
    groups of 16 with zero points), so the logits are the file's weights' and not a
    requantization's; a type without such a form (the other IQ types, TQ) arrives
    dequantized and is held in int8 groups of 32 (``GroupedInt8HeadMethod``). Float activations
    always (w4a8 too)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.converted:
            return
        if not self.q4_parts | self.q8_parts | self.int8_parts | self.iq4_parts:
            self.converted = True
            method = GroupedInt8HeadMethod()
            cast(Any, layer).quant_method = method
            method.process_weights_after_loading(layer)
            return
        super().process_weights_after_loading(layer)


class GGUFConfig(QuantizationConfig):
    """A GGUF file's linears as stored: 4-bit block types on the int4 kernel, the rest float32.
    The embedding is float32 (dequantized); the LM head from the file's blocks when it stores
    it block-quantized (``GGUFHeadMethod``), else float32."""

    name = "gguf"

    def __init__(self, quantized_head: bool = True, int8_activations: bool = False) -> None:
        self.quantized_head, self.int8_activations = quantized_head, int8_activations

    @classmethod
    def for_model(cls, model_extra: Mapping[str, Any]) -> QuantizationConfig:
        return cls(quantized_head=bool(model_extra.get("gguf_head_quantized", True)))

    def get_linear_method(self) -> LinearMethodBase:
        return GGUFLinearMethod(self.int8_activations)

    def get_lm_head_method(self) -> LinearMethodBase:
        return GGUFHeadMethod() if self.quantized_head else UnquantizedLinearMethod()


def block_parts(hf_name: str, qtype: str, raw: Callable[[], np.ndarray]) -> list[tuple[str, np.ndarray]] | None:
    """A linear's GGUF tensor (by its Hugging Face name and type name) as the parts it streams as,
    (suffix, array) in ``GGUFLinearMethod``'s forms from its rows' bytes ``raw()``: int4 parts
    (``Q4_SUFFIXES``), Q8_0's int8 values and scales (``Q8_SUFFIXES``) or int8 groups of 16
    (``INT8_SUFFIXES``); None for a tensor that loads dequantized."""
    if not _is_linear(hf_name):
        return None
    if qtype in Q4_TYPES:
        return list(zip(Q4_SUFFIXES, q4_to_int4(raw(), qtype)))
    if qtype == "Q8_0":
        return list(zip(Q8_SUFFIXES, q8_to_int8(raw())))
    if qtype in INT8_TYPES:
        return list(zip(INT8_SUFFIXES, blocks_to_int8(raw(), qtype)))
    if qtype in IQ4_TYPES:
        return list(zip(IQ4_SUFFIXES, iq4_to_codes(raw(), qtype)))
    return None


def _is_linear(hf_name: str) -> bool:
    return (hf_name.startswith("model.layers.") and hf_name.endswith("_proj.weight")) or hf_name == "lm_head.weight"
