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

Q8_0 linears (W = d q, q int8 per 32 inputs) stay 8-bit the same way: their int8 values and
block scales (``q8_to_int8``, exact) on the group-wise int8 op (``int8_groups.GroupedInt8Method``).
The other tensor types of a GGUF file (F32, F16, Q5_K, Q6_K, ...) load dequantized to float32, as
without this method; a fused projection whose parts mix kinds (Q4_K_M files keep some ``attn_v`` /
``ffn_down`` in Q6_K) runs as float32 too. So each linear registers every form, filled lazily (an
unused form never allocates), and ``process_weights_after_loading`` keeps one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from pagedllm.layers.quantization import int8_groups
from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig, WeightLoader, set_weight_attrs
from pagedllm.layers.quantization.int4 import Int4KernelMethod, dequantize
from pagedllm.layers.quantization.int8_groups import GroupedInt8HeadMethod
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod

logger = logging.getLogger(__name__)

GROUP = 32
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# The checkpoint names a 4-bit linear streams as (``models/gguf_loader``), after ``.weight``'s stem.
Q4_SUFFIXES = ("gguf_q", "gguf_scale", "gguf_zero")
# Q8_0 linears stream as their int8 values and block scales and stay int8 (``int8_groups``).
Q8_SUFFIXES = ("gguf_q8", "gguf_q8_scale")


def q4_to_int4(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``raw`` uint8 [rows, row_bytes] of one of ``Q4_TYPES`` -> (q uint8 [rows, K] in 0..15,
    scale and zero float32 [rows, K / 32]) with W = (q - zero) * scale."""
    rows = raw.shape[0]
    if qtype == "Q4_K":
        q, scale, offset = _q4_k(raw.reshape(-1, 144))
    else:
        blocks = raw.reshape(-1, 18 if qtype == "Q4_0" else 20)
        q = _nibbles(blocks[:, -16:], 16)
        scale = _f16(blocks[:, 0:2])
        offset = 8.0 * scale if qtype == "Q4_0" else -_f16(blocks[:, 2:4])
    q, scale, zero = _zero_points(q.reshape(-1, GROUP), scale.reshape(-1), offset.reshape(-1))
    return q.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1)


def q8_to_int8(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``raw`` uint8 [rows, row_bytes] of Q8_0 (34-byte blocks of 32: a float16 d, 32 int8 q;
    W = d q) -> (q int8 [rows, K], scale float32 [rows, K / 32]), exactly the file's values."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, 34)
    return blocks[:, 2:].view(np.int8).reshape(rows, -1).copy(), _f16(blocks[:, 0:2]).reshape(rows, -1)


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(two_bytes).view(np.float16).astype(np.float32).reshape(-1)


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


def _zero_points(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups W = scale q - offset -> (q, s, z) with W = (q - z) s; constant groups (scale 0) exact."""
    constant = scale == 0
    safe = np.where(constant, 1.0, scale).astype(np.float32)
    zero = np.where(constant, 0.0, offset / safe).astype(np.float32)
    q = np.where(constant[:, None], np.uint8(1), q).astype(np.uint8)
    return q, np.where(constant, -offset, scale).astype(np.float32), zero


def _lazy_param(
    layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, loader: WeightLoader, seen: set[Any]
) -> None:
    """An empty parameter that takes its full size on its first checkpoint tensor (recorded in ``seen``)."""
    param = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def load(param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        if param.numel() == 0:
            param.data = torch.empty(shape, dtype=dtype)
        loader(param, tensor, shard_id)
        seen.add(shard_id)

    # load_optional: either this form or the other fills a shard, which process_weights_after_loading checks.
    set_weight_attrs(param, output_dim=0, input_dim=1, weight_loader=load, load_optional=True)
    layer.register_parameter(name, param)


class GGUFLinearMethod(Int4KernelMethod):
    """A linear of a GGUF file: int4 when every part is a 4-bit block type, int8 groups of 32
    (``int8_groups.GroupedInt8Method``) when every part is Q8_0, else float32."""

    format_name = "gguf"

    def __init__(self, int8_activations: bool = False) -> None:
        super().__init__()
        self.int8_activations = int8_activations  # w4a8 on a GGUF file: the blocks with int8 activations
        self.float_parts: set[Any] = set()
        self.q4_parts: set[Any] = set()
        self.q8_parts: set[Any] = set()
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
            q_shapes = ((n, input_size), (n, input_size // GROUP), (n, input_size // GROUP))
            for name, shape, dtype in zip(Q4_SUFFIXES, q_shapes, (torch.uint8, torch.float32, torch.float32)):
                _lazy_param(layer, name, shape, dtype, weight_loader, self.q4_parts)
            for name, shape, dtype in zip(Q8_SUFFIXES, q_shapes, (torch.int8, torch.float32)):
                _lazy_param(layer, name, shape, dtype, weight_loader, self.q8_parts)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.converted:
            return
        parts = list(range(len(self.output_sizes))) if len(self.output_sizes) > 1 else [None]
        missing = [p for p in parts if p not in self.float_parts | self.q4_parts | self.q8_parts]
        if missing:
            raise ValueError(
                f"the GGUF file has no tensor for part(s) {missing} of a linear layer with outputs "
                f"{self.output_sizes}; the file does not match the model's shapes"
            )
        q4 = [getattr(layer, name).data for name in Q4_SUFFIXES] if self.q4_parts else None
        q8 = [getattr(layer, name).data for name in Q8_SUFFIXES] if self.q8_parts else None
        for name in (*Q4_SUFFIXES, *Q8_SUFFIXES):
            if hasattr(layer, name):
                delattr(layer, name)
        self.converted = True
        if q4 is not None and not self.float_parts and q8 is None:
            q, scale, zero = q4
            self.finish_int4(layer, q, scale, zero, None)
            return
        if q8 is not None and not self.float_parts and q4 is None and int8_groups.can_store(q8[0]):
            int8_method = int8_groups.GroupedInt8Method()
            int8_method.store(layer, *q8)
            cast(Any, layer).quant_method = int8_method
            return
        # A fused projection with parts of several kinds (or no kernel for them): all float.
        if q4 is not None:
            self._fill_float(layer, dequantize(*q4), self.q4_parts)
        if q8 is not None:
            self._fill_float(layer, int8_groups.dequantize_groups(*q8), self.q8_parts)
        if self.int8_activations:
            logger.warning(
                "w4a8: a linear with outputs %s is not stored in a 4-bit block type (Q4_0 / Q4_1 / Q4_K) in the "
                "GGUF file; it runs as float32 with float activations (the decode stack then stays off)",
                self.output_sizes,
            )
        method = UnquantizedLinearMethod()
        cast(Any, layer).quant_method = method
        method.process_weights_after_loading(layer)

    def _fill_float(self, layer: nn.Module, w: torch.Tensor, parts: set[Any]) -> None:
        """The rows of ``parts`` (a block kind's) of the float weight from that kind's dequantization ``w``."""
        weight = cast(nn.Parameter, layer.weight)
        if weight.numel() == 0:
            weight.data = torch.empty(w.shape, dtype=self.params_dtype)
        start = 0
        for part, size in enumerate(self.output_sizes):
            if part in parts or (part == 0 and None in parts):
                weight.data[start : start + size] = w[start : start + size]
            start += size


class GGUFConfig(QuantizationConfig):
    """A GGUF file's linears as stored: 4-bit block types on the int4 kernel, the rest float32.
    The embedding is float32 (dequantized); the LM head is in int8 groups of 32 when the file
    stores it block-quantized (a Q8_0 head comes back exactly: ``int8_groups``), else float32."""

    name = "gguf"

    def __init__(self, quantized_head: bool = True, int8_activations: bool = False) -> None:
        self.quantized_head, self.int8_activations = quantized_head, int8_activations

    @classmethod
    def for_model(cls, model_extra: Mapping[str, Any]) -> QuantizationConfig:
        return cls(quantized_head=bool(model_extra.get("gguf_head_quantized", True)))

    def get_linear_method(self) -> LinearMethodBase:
        return GGUFLinearMethod(self.int8_activations)

    def get_lm_head_method(self) -> LinearMethodBase:
        return GroupedInt8HeadMethod() if self.quantized_head else UnquantizedLinearMethod()


def is_q4_linear(hf_name: str, qtype: str) -> bool:
    """Whether a GGUF tensor (by its Hugging Face name and type name) streams as int4 parts."""
    return qtype in Q4_TYPES and _is_linear(hf_name)


def is_q8_linear(hf_name: str, qtype: str) -> bool:
    """Whether a GGUF tensor streams as int8-group parts (``Q8_SUFFIXES``)."""
    return qtype == "Q8_0" and _is_linear(hf_name)


def _is_linear(hf_name: str) -> bool:
    return hf_name.startswith("model.layers.") and hf_name.endswith("_proj.weight")
