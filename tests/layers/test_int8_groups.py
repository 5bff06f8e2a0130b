"""The LM head in int8 groups of 32 (``layers/quantization/int8_groups.py``): the kernel
(csrc/cpu_gemm_grouped.cpp, packed_linear_int8_grouped, with and without zero points) at every
ISA level against an exact numpy dequantize-then-matmul, the quantizer (Q8_0 blocks come back exactly), and the head of each format."""

import numpy as np
import pytest
import torch

from pagedllm.layers import cpu_gemm_kernels
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.quantization import building_with, get_quantization_config, int8_groups
from pagedllm.layers.quantization.gguf import GGUFConfig, GGUFHeadMethod
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod

# Rows 1-19 run the fused tile (heights 1-4 and remainders), from 20 the dequantize-then-fp32 path.
ROWS = [1, 2, 3, 4, 5, 7, 16, 19, 20, 21, 64]
# (N, K, G): one panel; a full interleaved group of 4 panels plus a 3-panel tail (112 = 64 + 48);
# a 2-panel tail; single and many groups along K.
SHAPES = [(16, 32, 32), (112, 64, 32), (96, 96, 32), (32, 16, 16), (208, 576, 32)]


def _random(n: int, k: int, group: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    q = rng.integers(-127, 128, size=(n, k), dtype=np.int8)
    scale = (rng.random((n, k // group)) * 0.02).astype(np.float32)
    scale[0, 0] = 0.0  # an all-zero block, as Q8_0 writes one
    return q, scale


def _reference(
    x: np.ndarray, q: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, zero: np.ndarray | None = None
) -> np.ndarray:
    group = q.shape[1] // scale.shape[1]
    values = q.astype(np.float64) - (0.0 if zero is None else np.repeat(zero.astype(np.float64), group, axis=1))
    w = values * np.repeat(scale.astype(np.float64), group, axis=1)
    y = x.astype(np.float64) @ w.T
    return y if bias is None else y + bias


def _run(
    op,
    x: np.ndarray,
    q: np.ndarray,
    scale: np.ndarray,
    bias: np.ndarray | None,
    group: int,
    zero: np.ndarray | None = None,
    params: torch.dtype = torch.float32,
) -> np.ndarray:
    return op(
        torch.from_numpy(x),
        cpu_gemm_kernels.pack_int8(torch.from_numpy(q)),
        cpu_gemm_kernels.pack_groups(torch.from_numpy(scale), params),
        None if bias is None else torch.from_numpy(bias),
        group,
        None if zero is None else cpu_gemm_kernels.pack_groups(torch.from_numpy(zero), params),
    ).numpy()


@pytest.mark.parametrize("with_zero", [False, True])
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_every_isa_matches_numpy_dequantize_then_matmul(isa_ops, rows, n, k, group, with_zero):
    rng = np.random.default_rng(rows * 1000 + n + k)
    q, scale = _random(n, k, group, rng)
    # With zero points (GGUF's 5-bit types, 4-bit parts of a mixed layer): W = (q - z) * s.
    zero = (rng.random(scale.shape) * 31).astype(np.float32) if with_zero else None
    # Even row counts read float16 scales and zero points (pack_group_params' exact case).
    params = torch.float16 if rows % 2 == 0 else torch.float32
    if params == torch.float16:
        scale = scale.astype(np.float16).astype(np.float32)
        zero = None if zero is None else zero.astype(np.float16).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if rows % 2 else None
    got = _run(isa_ops.packed_linear_int8_grouped.default, x, q, scale, bias, group, zero, params)
    want = _reference(x, q, scale, bias, zero)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())))


@pytest.fixture(scope="module")
def native():
    op = int8_groups.load_grouped_int8_gemm()
    if op is None:
        pytest.skip("the C++ kernels could not be built here")
    return op


def test_head_shapes_across_threads_and_bad_inputs(native):
    rng = np.random.default_rng(0)
    q, scale = _random(1024, 576, 32, rng)  # enough bytes per call to use both threads
    for rows in (1, 4, 16):
        x = rng.standard_normal((rows, 576)).astype(np.float32)
        np.testing.assert_allclose(
            _run(native, x, q, scale, None, 32), _reference(x, q, scale, None), rtol=1e-4, atol=1e-4
        )
    packed = cpu_gemm_kernels.pack_int8(torch.from_numpy(q))
    scales = cpu_gemm_kernels.pack_groups(torch.from_numpy(scale))
    assert native(torch.randn(0, 576), packed, scales, None, 32).shape == (0, 1024)
    with pytest.raises(RuntimeError, match="must divide K"):
        native(torch.randn(1, 576), packed, scales, None, 50)
    with pytest.raises(RuntimeError, match="int8"):
        native(torch.randn(1, 576), packed.view(torch.uint8), scales, None, 32)


def test_quantizer_is_q8_0_and_recovers_a_q8_0_block_exactly():
    torch.manual_seed(0)
    w = torch.randn(32, 128) * torch.logspace(-3, 1, 32)[:, None]
    w[3, :32] = 0.0  # an all-zero block: scale 0, q 0
    q, scale = int8_groups.quantize_groups(w)
    assert q.dtype == torch.int8 and scale.shape == (32, 4) and int(q.abs().max()) == 127
    assert scale[3, 0] == 0 and not q[3, :32].any()
    err = (int8_groups.dequantize_groups(q, scale) - w).abs()
    assert bool((err <= scale.repeat_interleave(32, dim=1) / 2 + 1e-7).all())
    # A Q8_0 block as llama.cpp stores it: q with a float16 scale d; dequantized, then quantized again.
    d = torch.tensor([0.0123, 3.5e-4, 7.25], dtype=torch.float16).float()
    stored = torch.randint(-127, 128, (3, 32), dtype=torch.int8)
    stored[:, 0] = 127  # the block's largest value is 127 d
    q2, scale2 = int8_groups.quantize_groups(stored.float() * d[:, None])
    assert torch.equal(q2, stored)
    torch.testing.assert_close(scale2[:, 0], d, rtol=2e-7, atol=0)


def _head(config, tied: bool) -> tuple[ParallelLMHead, VocabParallelEmbedding]:
    with building_with(config):
        embed = VocabParallelEmbedding(96, 64)
        head = ParallelLMHead(96, 64)
    torch.manual_seed(1)
    embed.weight.data.normal_()
    if tied:
        head.tie_weights(embed)
    else:
        head.weight.data.normal_()
    return head, embed


@pytest.mark.parametrize("name", ["int8", "int4", "w4a8"])  # w8a8's head is W8A8 (test_cpu_gemm_w8a8.py)
def test_quantizing_formats_hold_the_head_in_int8_groups_and_embedding_lookups_stay_float(native, name):
    head, embed = _head(get_quantization_config(name), tied=True)
    table = embed.weight.data.clone()
    head.quant_method.process_weights_after_loading(head)
    assert isinstance(head.quant_method, int8_groups.GroupedInt8HeadMethod)
    assert head.weight.dtype == torch.int8 and head.weight.shape == (6, 64, 16)
    assert embed.weight.dtype == torch.float32 and torch.equal(embed.weight.data, table)  # lookups unchanged
    x = torch.randn(3, 64)
    q, scale = int8_groups.quantize_groups(table)
    torch.testing.assert_close(head(x), x @ int8_groups.dequantize_groups(q, scale).T, rtol=1e-4, atol=1e-4)
    exact = x @ table.T
    assert float((head(x) - exact).norm() / exact.norm()) < 0.01  # near the float head
    head.quant_method.process_weights_after_loading(head)  # once only
    assert head.weight.dtype == torch.int8


def test_gguf_head_follows_the_file_and_unpackable_heads_stay_float(native):
    # From the file's blocks (requantized to int8 groups of 32 only in a type without an integer form).
    assert isinstance(GGUFConfig.for_model({"gguf_head_quantized": True}).get_lm_head_method(), GGUFHeadMethod)
    assert isinstance(
        GGUFConfig.for_model({"gguf_head_quantized": False}).get_lm_head_method(), UnquantizedLinearMethod
    )
    assert isinstance(get_quantization_config(None).get_lm_head_method(), UnquantizedLinearMethod)
    with building_with(get_quantization_config("int8")):
        odd = ParallelLMHead(40, 64)  # 40 rows: not whole panels of 16
    odd.weight.data.normal_()
    w = odd.weight.data.clone()
    odd.quant_method.process_weights_after_loading(odd)
    assert isinstance(odd.quant_method, UnquantizedLinearMethod)
    x = torch.randn(2, 64)
    torch.testing.assert_close(odd(x), x @ w.T, rtol=1e-5, atol=1e-5)  # exactly the float head
