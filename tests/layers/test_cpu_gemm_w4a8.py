"""W4A8 (``--quantization w4a8``): the op (csrc/cpu_gemm_grouped.cpp, packed_linear_w4a8) at every
ISA level against numpy (the activations quantized per run of 32 inputs, then an exact matmul on the
dequantized int4 weights), its error against float activations, the method and the engine."""

import numpy as np
import pytest
import torch

from pagedllm.layers import cpu_gemm_kernels
from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.quantization import building_with, get_quantization_config, int4
from pagedllm.layers.quantization.int4 import load_w4a8_gemm
from pagedllm.layers.quantization.w4a8 import W4A8LinearMethod
from tests.layers.int4_reference import as_tensor, dequantize, kernel_params, random_int4

ROWS = [1, 2, 3, 4, 5, 7, 16, 17, 64]
# (N, K, G): one panel; a full group of 4 panels plus a 3-panel tail; runs of G when 32 does not
# divide it (16, 24); several runs per group (G 128); the SmolLM shapes.
SHAPES = [(16, 32, 32), (112, 64, 64), (48, 96, 24), (32, 48, 16), (64, 1536, 128), (80, 576, 64)]


def _quantized_activations(x: np.ndarray, group: int) -> np.ndarray:
    """x with each run of A inputs (32, or G when 32 does not divide G) rounded to its int8 grid, in
    the op's float32 arithmetic (q = round-half-even(x * (127 / max|x|)), scale = max|x| / 127)."""
    run = 32 if group % 32 == 0 else group
    runs = x.astype(np.float32).reshape(x.shape[0], -1, run)
    amax = np.abs(runs).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    q = np.round(runs * inv.astype(np.float32))
    return (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


def _args(q, scale, zero, params: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    return (
        int4.pack_int4(as_tensor(q)),
        cpu_gemm_kernels.pack_groups(as_tensor(scale), params),
        cpu_gemm_kernels.pack_groups(as_tensor(zero), params),
    )


def _run(
    op, x: np.ndarray, q, scale, zero, bias, group: int, params: torch.dtype = torch.float32, offset: bool = False
) -> np.ndarray:
    args = _args(q, scale, zero, params)
    return op(as_tensor(x), *args, None if bias is None else as_tensor(bias), group, offset).numpy()


# The parameters' forms: float32 or float16 zero points, float16 offsets (GGUF Q4_1).
@pytest.mark.parametrize("form", ["float32", "float16", "offsets"])
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_every_isa_matches_numpy_on_the_quantized_activations(isa_ops, rows, n, k, group, form):
    rng = np.random.default_rng(rows * 1000 + n + k)
    q, scale, zero, g_idx = random_int4(n, k, group, rng)
    weights, scale, second, params, offset = kernel_params(q, scale, zero, g_idx, form)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, : min(k, 32)] = 0.0  # an all-zero run: scale 0
    bias = rng.standard_normal(n).astype(np.float32) if rows % 2 else None
    w = weights.astype(np.float64)
    want = _quantized_activations(x, group) @ w.T + (0 if bias is None else bias)
    got = _run(isa_ops.packed_linear_w4a8.default, x, q, scale, second, bias, group, params, offset)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())))
    # Against float activations: the int8 rounding, about a percent of the output's scale.
    exact = x.astype(np.float64) @ w.T + (0 if bias is None else bias)
    assert float(np.abs(got - exact).max()) < 0.03 * float(np.abs(exact).max())


@pytest.fixture(scope="module")
def native():
    op = load_w4a8_gemm()
    if op is None:
        pytest.skip("the C++ kernels could not be built here")
    return op


def test_bad_inputs_are_errors(native):
    rng = np.random.default_rng(0)
    q, scale, zero, _ = random_int4(32, 64, 32, rng)
    args = _args(q, scale, zero)
    assert native(torch.randn(0, 64), *args, None, 32).shape == (0, 32)
    assert native(torch.randn(2, 3, 64), *args, None, 32).shape == (2, 3, 32)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        native(torch.randn(1, 64), *args, None, 4)
    with pytest.raises(RuntimeError, match="float32"):
        native(torch.randn(1, 64, dtype=torch.float64), *args, None, 32)


def test_the_method_holds_int4_weights_and_runs_the_w4a8_op(native):
    torch.manual_seed(0)
    with building_with(get_quantization_config("w4a8")):
        layer = ColumnParallelLinear(256, 96)
    with building_with(get_quantization_config("int4")):
        float_acts = ColumnParallelLinear(256, 96)
    w = torch.randn(96, 256)
    for lin in (layer, float_acts):
        lin.weight.data.copy_(w)
        lin.quant_method.process_weights_after_loading(lin)
    assert isinstance(layer.quant_method, W4A8LinearMethod) and layer.weight.dtype == torch.uint8
    assert torch.equal(layer.weight, float_acts.weight)  # int4's weights, bit for bit
    x = torch.randn(5, 256)
    got, ref = layer(x), float_acts(x)
    assert not torch.equal(got, ref)  # the activations were rounded ...
    assert float((got - ref).norm() / ref.norm()) < 0.02  # ... to within about a percent


def test_engine_runs_w4a8_close_to_int4(llama_model_dir):
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = {"prompt_token_ids": [1, 5, 9, 13, 40, 80, 120, 160]}
    logprobs = {}
    for name in ("int4", "w4a8"):
        llm = LLM(str(llama_model_dir), quantization=name, kv_cache_memory=0.05, max_model_len=64)
        assert llm.llm_engine.config.model_config.quantization == name
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        logprobs[name] = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
        del llm
    diff = np.abs(np.array(logprobs["w4a8"]) - np.array(logprobs["int4"]))
    assert 0 < diff.max() < 0.2, diff  # the same model up to the activations' rounding


def test_smollm_shapes_across_threads_and_extreme_inputs(native):
    rng = np.random.default_rng(1)
    q, scale, zero, g_idx = random_int4(960, 576, 64, rng)  # enough bytes to use both threads
    w = dequantize(q, scale, zero, g_idx).astype(np.float64)
    for rows in (1, 4, 64):
        x = rng.standard_normal((rows, 576)).astype(np.float32)
        got = _run(native, x, q, scale, zero, None, 64)
        np.testing.assert_allclose(got, _quantized_activations(x, 64) @ w.T, rtol=1e-4, atol=1e-3)
    # A run of subnormals quantizes to zeros and a run holding inf propagates (no undefined
    # float-to-int conversion in either).
    x = rng.standard_normal((2, 576)).astype(np.float32)
    x[0, :32] = 1e-39
    x[1, 32:64] = np.inf
    got = _run(native, x, q, scale, zero, None, 64)
    assert not np.isfinite(got[1]).all()
    x[0, :32] = 0.0
    np.testing.assert_allclose(got[:1], _quantized_activations(x[:1], 64) @ w.T, rtol=1e-4, atol=1e-3)
