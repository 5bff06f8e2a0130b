"""W4A8 for CPU (``--quantization w4a8``): group-wise int4 weights and int8 activations.

The weights are ``--quantization int4``'s (the same quantizer, groups and packed layout; a float
checkpoint is quantized as it streams in); the op (``csrc/cpu_gemm_grouped.cpp``,
``packed_linear_w4a8``) quantizes the activations per row and run of 32 inputs (xs = max|x| / 127,
as llama.cpp feeds its Q4 matrices Q8_0 activations) and sums xq * q in int32 with the int8 dot
product instructions, 4 products per instruction and lane: AVX-512 VNNI, AVX-VNNI, vpmaddubsw
elsewhere on x86, Arm dotprod.

Where it pays: from a few rows on, where the float int4 tile is bound by widening the nibbles
(one shift, one table lookup and one FMA per 16 weights): on the SmolLM-135M-shaped linears
(2-core Zen 4, AVX-512 VNNI) about 1.2x int4 at 4 rows and 1.6-1.9x at 16-64 rows. At one row both
are bound by reading the weights and run level. The cost is the activations' rounding (each
within xs / 2 of its value), on top of int4's weight error; ``int4`` keeps float activations and
equals a float matmul on its dequantized weights. The LM head is in int8 groups of 32, as for
int4. CPU only.
"""

from __future__ import annotations

from functools import lru_cache

from pagedllm.layers.cpu_kernels import cpu_ops
from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig
from pagedllm.layers.quantization.int4 import Int4LinearMethod, LinearInt4
from pagedllm.layers.quantization.int8_groups import GroupedInt8HeadMethod


@lru_cache(maxsize=1)
def load_w4a8_gemm() -> LinearInt4 | None:
    """``packed_linear_w4a8(x, packed, scale, zero, bias, group_size)`` of the selected build, or
    None when the CPU kernels are disabled or the build failed."""
    ops = cpu_ops()
    return None if ops is None else ops.packed_linear_w4a8.default


class W4A8LinearMethod(Int4LinearMethod):
    """int4's weights (``Int4LinearMethod``) run by the int8-activation op."""

    format_name = "w4a8"

    def cpu_kernel(self) -> LinearInt4 | None:
        return load_w4a8_gemm()


class W4A8Config(QuantizationConfig):
    """W4A8 for the transformer's linears; the LM head in int8 groups of 32 (``int8_groups``)."""

    name = "w4a8"
    quantize_on_load = W4A8LinearMethod

    def get_linear_method(self) -> LinearMethodBase:
        return W4A8LinearMethod()

    def get_lm_head_method(self) -> LinearMethodBase:
        return GroupedInt8HeadMethod()
