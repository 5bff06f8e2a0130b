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
int4 (float where that kernel cannot take it, and on a GGUF file whose head is float). On a GGUF file the method keeps the file's Q4_0 / Q4_1 / Q4_K blocks as ``gguf`` does (no
requantization) and runs them with int8 activations, as llama.cpp does. CPU only.

Why it is not the default for GGUF files: the rounding flips near-ties. Asked "What is the capital
of France?" (chat template, greedy), SmolLM2-135M-Instruct's first token is nearly a tie ("The"
-1.88, "L" -1.96 with float activations); ``gguf`` answers "The capital of France is Paris." as
transformers does, while w4a8 answers "L'Étoile, ...", as llama.cpp does on the same file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedllm.layers.quantization.base import LinearMethodBase, QuantizationConfig
from pagedllm.layers.quantization.gguf import GGUFConfig
from pagedllm.layers.quantization.int4 import Int4LinearMethod
from pagedllm.layers.quantization.int8_groups import GroupedInt8HeadMethod


class W4A8LinearMethod(Int4LinearMethod):
    """int4's weights (``Int4LinearMethod``) run by the int8-activation op."""

    format_name = "w4a8"
    int8_activations = True


class W4A8Config(QuantizationConfig):
    """W4A8 for the transformer's linears; the LM head in int8 groups of 32 (``int8_groups``). On
    a GGUF file, its 4-bit blocks as stored (``GGUFConfig`` with int8 activations), not requantized."""

    name = "w4a8"
    quantize_on_load = W4A8LinearMethod

    @classmethod
    def for_model(cls, model_extra: Mapping[str, Any]) -> QuantizationConfig:
        if "gguf_file" in model_extra:
            return GGUFConfig(bool(model_extra.get("gguf_head_quantized", True)), int8_activations=True)
        return cls()

    def get_linear_method(self) -> LinearMethodBase:
        return W4A8LinearMethod()

    def get_lm_head_method(self) -> LinearMethodBase:
        return GroupedInt8HeadMethod()
