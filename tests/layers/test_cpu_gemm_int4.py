"""Group-wise int4 (``--quantization int4``): the kernel (csrc/cpu_gemm_grouped.cpp) at every ISA level
against an exact numpy dequantize-then-matmul, the packing, the quantizer, the layer."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import cpu_gemm_kernels, cpu_kernels
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import int4, int8_groups
from tests.layers.int4_reference import as_tensor, dequantize, kernel_params, random_int4, reference_linear

# Rows 1-19: every fused tile height (1-4) and remainders; from 20 the dequantize-then-fp32
# path: 20, 21 and 64 (the fp32 micro-kernel's row tiles and remainders).
ROWS = [1, 2, 3, 4, 5, 7, 9, 15, 16, 19, 20, 21, 64]
# (N, K, G): one panel; 3 and 4 + 3 panels (a partial thread group); K not a multiple of any
# vector width, with small and single groups; a wide K.
SHAPES = [(16, 16, 16), (48, 96, 32), (112, 40, 8), (80, 24, 24), (32, 200, 40), (64, 1536, 128)]


@pytest.fixture(scope="module")
def native():
    op = int4.load_int4_gemm()
    if op is None:
        pytest.skip("the C++ int4 GEMM kernel could not be built here")
    return op


def _check(op, rows: int, n: int, k: int, group: int, with_bias: bool, form: str = "float32") -> None:
    rng = np.random.default_rng(rows * 1000 + n + k)
    q, scale, zero, g_idx = random_int4(n, k, group, rng)
    w, scale, second, dtype, offset = kernel_params(q, scale, zero, g_idx, form)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    want = reference_linear(x, w, bias)
    got = op(
        as_tensor(x),
        int4.pack_int4(as_tensor(q)),
        cpu_gemm_kernels.pack_groups(as_tensor(scale), dtype),
        cpu_gemm_kernels.pack_groups(as_tensor(second), dtype),
        None if bias is None else as_tensor(bias),
        group,
        offset,
    )
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)


# The parameters' forms: float32 or float16 zero points, float16 offsets (GGUF Q4_1).
@pytest.mark.parametrize("form", ["float32", "float16", "offsets"])
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_every_isa_matches_numpy_dequantize_then_matmul(isa_ops, rows, n, k, group, form):
    _check(isa_ops.packed_linear_int4.default, rows, n, k, group, with_bias=rows % 2 == 1, form=form)


# NF4's code table (bitsandbytes), and one with every value distinct and unordered.
TABLES = {
    "nf4": [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
            0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0],
    "shuffled": [3.5, -2.0, 0.25, 7.0, -0.5, 1.0, -6.0, 2.0, 0.0, -1.5, 4.0, -3.0, 0.75, 5.5, -0.125, 6.25],
}  # fmt: skip


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_code_table_at_every_isa_matches_numpy(isa_ops, rows, n, k, group, table):
    """packed_linear_int4_table: W = table[q] * s (bitsandbytes NF4 / FP4), every index of the
    table (bit 3 picks AVX2's upper half) on both paths (fused tile, dequantize then fp32)."""
    rng = np.random.default_rng(rows * 1000 + n + k)
    q, scale, _, g_idx = random_int4(n, k, group, rng)
    values = np.array(TABLES[table], dtype=np.float32)
    w = values[q] * scale[:, g_idx]
    x = rng.standard_normal((rows, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if rows % 2 else None
    got = isa_ops.packed_linear_int4_table.default(
        as_tensor(x),
        int4.pack_int4(as_tensor(q)),
        cpu_gemm_kernels.pack_groups(as_tensor(scale), torch.float32 if rows % 3 else torch.float16),
        torch.from_numpy(values),
        None if bias is None else as_tensor(bias),
        group,
    )
    np.testing.assert_allclose(got.numpy(), reference_linear(x, w, bias), rtol=1e-4, atol=1e-4)


def test_code_table_must_be_16_floats(native):
    ops = cpu_kernels.cpu_ops()
    q = torch.zeros(16, 16, dtype=torch.uint8)
    args = (torch.randn(2, 16), int4.pack_int4(q), cpu_gemm_kernels.pack_groups(torch.ones(16, 1)))
    for bad in (torch.zeros(8), torch.zeros(16, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="16 values"):
            ops.packed_linear_int4_table(*args, bad, None, 16)


def test_smollm_shapes_across_threads_and_batched_input(native):
    for rows in (1, 4, 16):
        for n, k in [(960, 576), (576, 1536)]:
            _check(native, rows, n, k, 64, with_bias=False)
    rng = np.random.default_rng(0)
    q, scale, zero, g_idx = random_int4(32, 64, 16, rng)
    args = (
        int4.pack_int4(as_tensor(q)),
        cpu_gemm_kernels.pack_groups(as_tensor(scale)),
        cpu_gemm_kernels.pack_groups(as_tensor(zero)),
    )
    x = torch.randn(5, 3, 64)
    want = reference_linear(x.reshape(15, 64).numpy(), dequantize(q, scale, zero, g_idx)).reshape(5, 3, 32)
    np.testing.assert_allclose(native(x, *args, None, 16).numpy(), want, rtol=1e-4, atol=1e-4)
    assert native(torch.randn(0, 64), *args, None, 16).shape == (0, 32)
    with pytest.raises(RuntimeError, match="must divide K"):
        native(x, *args, None, 48)


def test_pack_int4_layout_and_roundtrip():
    q = torch.randint(0, 16, (112, 24), dtype=torch.uint8)  # a full group of 64 outputs and a 3-panel tail
    packed = int4.pack_int4(q)
    assert packed.shape == (7, 24, 8) and packed.dtype == torch.uint8
    words = packed.reshape(-1).view(torch.int32)

    def word(n: int, b: int) -> int:  # output n's inputs 8 b .. 8 b + 7, input 8 b + i in bits 4i..4i+3
        return sum(int(q[n, 8 * b + i]) << (4 * i) for i in range(8)) & 0xFFFFFFFF

    # Group 0 (outputs 0-63), 3 blocks of [4 panels x 16 words]; output 16 j + l of block b at (4 b + j) 16 + l.
    assert int(words[(4 * 2 + 1) * 16 + 5]) & 0xFFFFFFFF == word(16 + 5, 2)
    # The tail (outputs 64-111, 3 panels) after the 64 x 24 / 8 words of group 0.
    assert int(words[64 * 3 + (3 * 1 + 2) * 16 + 7]) & 0xFFFFFFFF == word(64 + 32 + 7, 1)
    assert torch.equal(int4.unpack_int4(packed), q)
    with pytest.raises(ValueError, match="in_features % 8"):
        int4.pack_int4(torch.zeros(16, 12, dtype=torch.uint8))
    groups = torch.arange(48 * 2, dtype=torch.float32).reshape(48, 2)
    assert cpu_gemm_kernels.pack_groups(groups)[2, 1, 5] == groups[32 + 5, 1]


def test_group_params_are_float16_only_where_every_value_is_exact():
    scale = torch.tensor([[0.5, 2.0**-14], [1000.0, 0.0]]).repeat(8, 1)  # 16 outputs, 2 groups
    zero = torch.tensor([[8.0, 3.0], [0.0, 15.0]]).repeat(8, 1)
    packed_scale, packed_zero = cpu_gemm_kernels.pack_group_params(scale, zero)
    assert packed_scale is not None and packed_zero is not None
    assert packed_scale.dtype == packed_zero.dtype == torch.float16 and packed_scale.shape == (1, 2, 16)
    assert torch.equal(packed_scale.float(), cpu_gemm_kernels.pack_groups(scale))
    # Q4_1's zero point -m / d is rarely a float16: the layer's values all stay float32.
    assert [t.dtype for t in cpu_gemm_kernels.pack_group_params(scale, zero + 1 / 3) if t is not None] == [
        torch.float32
    ] * 2
    assert cpu_gemm_kernels.pack_group_params(scale, None)[1] is None
    # fp16_scales: float16 values (up: at or above), unless a scale would lose float16 precision.
    s = torch.rand(64) + 0.01
    up = cpu_gemm_kernels.fp16_scales(s, up=True)
    assert torch.equal(up.half().float(), up) and (up >= s).all() and ((up - s) / s).max() <= 2**-10
    near = cpu_gemm_kernels.fp16_scales(s)
    assert torch.equal(near, s.half().float())
    for outside in (1e-6, 1e5):
        t = torch.cat([s, torch.tensor([outside])])
        assert torch.equal(cpu_gemm_kernels.fp16_scales(t, up=True), t)


def test_quantization_error_bound_and_group_choice():
    torch.manual_seed(0)
    w = torch.randn(32, 256) * torch.logspace(-3, 1, 32)[:, None]
    w[3] = 0.0  # an all-zero row: scale 1, q = zero
    w[4] = 0.25  # a constant positive row: one float16 rounding of its scale away (0 is in every group's range)
    q, scale, zero = int4.quantize_groupwise(w, 128)
    assert q.dtype == torch.uint8 and q.max() <= 15 and scale.shape == zero.shape == (32, 2)
    assert torch.equal(zero, zero.round()) and zero.min() >= 0 and zero.max() <= 15
    error = (int4.dequantize(q, scale, zero) - w).abs()
    assert (error <= scale.repeat_interleave(128, dim=1) / 2 * (1 + 1e-5)).all()
    assert torch.equal(int4.dequantize(q, scale, zero)[3], w[3])
    torch.testing.assert_close(int4.dequantize(q, scale, zero)[4], w[4], rtol=2**-10, atol=0)
    # The scales are float16 values (the kernel reads them in half the bytes), rounded up.
    assert torch.equal(scale.half().float(), scale)
    assert [int4.choose_group_size(k) for k in (576, 1536, 192, 80)] == [64, 128, 64, 16]
    with pytest.raises(ValueError, match="in_features=72"):
        int4.choose_group_size(72)


def test_layers_quantize_and_match(native):
    torch.manual_seed(1)
    column = ColumnParallelLinear(256, 48, bias=True, quant_config=int4.Int4Config())
    row = RowParallelLinear(192, 32, bias=False, quant_config=int4.Int4Config())
    for layer, group in ((column, 128), (row, 64)):
        with torch.no_grad():
            layer.weight.normal_()
            if layer.bias is not None:
                layer.bias.normal_()
        w = layer.weight.detach().clone()
        b = None if layer.bias is None else layer.bias.detach().clone()
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.weight.dtype == torch.uint8 and layer.quant_method.group_size == group
        x = torch.randn(3, w.shape[1])
        reference = F.linear(x, int4.dequantize(*int4.quantize_groupwise(w, group)), b)
        torch.testing.assert_close(layer(x), reference, rtol=1e-4, atol=1e-4)


def test_layer_the_kernel_cannot_take_stays_float(native):
    layer = ColumnParallelLinear(64, 40, bias=False, quant_config=int4.Int4Config())  # 40: not a multiple of 16
    with torch.no_grad():
        layer.weight.normal_()
    w = layer.weight.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float32
    x = torch.randn(3, 64)
    reference = F.linear(x, int4.dequantize(*int4.quantize_groupwise(w, 64)))
    torch.testing.assert_close(layer(x), reference, rtol=1e-4, atol=1e-4)


def test_in_features_without_a_group_is_a_clear_error():
    with pytest.raises(ValueError, match="divisible by a group size"):
        ColumnParallelLinear(72, 32, quant_config=int4.Int4Config())


def test_engine_int4_greedy_matches_transformers_on_the_dequantized_weights(llama_model_dir, tmp_path, native):
    """--quantization int4 on a float checkpoint equals transformers on that checkpoint with each
    linear replaced by its int4 dequantization and the LM head by its int8 groups (the quantizers are
    per row, so fusing is transparent)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    float_dir = tmp_path / "dequantized"
    shutil.copytree(llama_model_dir, float_dir)
    state = load_file(str(llama_model_dir / "model.safetensors"))
    for name, w in state.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            state[name] = int4.dequantize(*int4.quantize_groupwise(w, int4.choose_group_size(w.shape[1])))
    save_file(state, str(float_dir / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32)
    hf.lm_head.weight = torch.nn.Parameter(
        int8_groups.dequantize_groups(*int8_groups.quantize_groups(hf.lm_head.weight))
    )
    llm = LLM(str(llama_model_dir), quantization="int4", kv_cache_memory=0.05, max_model_len=128)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    linears = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), int4.Int4LinearMethod)]
    assert len(linears) == 8 and all(m.weight.dtype == torch.uint8 for m in linears)  # 2 layers x 4
    prompts = [[1, 5, 9, 13], [5, 40, 80, 120, 160, 200]]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt) :].tolist()
