"""Weight-only int8 (``--quantization int8``): the kernel (csrc/cpu_gemm_int8.cpp) against torch
on the dequantized weight, the quantizer's error bound, the layers and the engine end to end."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.config import EngineArgs
from pagedllm.layers import cpu_gemm_kernels
from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.quantization import get_quantization_config
from pagedllm.layers.quantization import int8 as quant
from tests.layers.test_cpu_gemv import ISA_ROWS, ISA_SHAPES

# Rows 1-9 cover every tile height (1-6) and a tile plus a remainder; 64 a larger decode batch.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 64]
# (out, in): one panel, a 4-panel group plus a narrower last group (32, 48, 16 rows), an odd K, a wide K.
SHAPES = [(16, 1), (96, 64), (48, 33), (80, 1536)]


@pytest.fixture(scope="module")
def native():
    op = quant.load_int8_gemm()
    if op is None:
        pytest.skip("the C++ int8 GEMM kernel could not be built here")
    return op


def _check(op, rows, n, k, with_bias):
    torch.manual_seed(rows * 1000 + n + k)
    w, x = torch.randn(n, k), torch.randn(rows, k)
    b = torch.randn(n) if with_bias else None
    q, scale = quant.quantize_per_channel(w)
    reference = F.linear(x, q.float() * scale[:, None], b)
    torch.testing.assert_close(op(x, cpu_gemm_kernels.pack_int8(q), scale, b), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_native_matches_dequantized_reference(native, rows, n, k):
    _check(native, rows, n, k, with_bias=rows % 2 == 1)


@pytest.mark.parametrize("n,k", ISA_SHAPES)
@pytest.mark.parametrize("rows", ISA_ROWS)
def test_every_isa_matches_dequantized_reference(isa_ops, rows, n, k):
    # Every level's tile heights and widths (see test_cpu_gemv); in the int8 layout a narrower
    # last group (48: 3 panels; 80: 4 + 1) is interleaved at its own width.
    _check(isa_ops.packed_linear_int8.default, rows, n, k, with_bias=True)


def test_smollm_shapes_across_threads_and_batched_input(native):
    for n, k in [(960, 576), (576, 1536), (976, 576)]:  # 976: 15 groups + a 16-row one
        _check(native, 4, n, k, with_bias=False)
    w, x = torch.randn(32, 64), torch.randn(5, 3, 64)
    packed, scale = quant.quantize_and_pack(w)
    reference = F.linear(x, quant.quantize_per_channel(w)[0].float() * scale[:, None])
    torch.testing.assert_close(native(x, packed, scale, None), reference, rtol=1e-4, atol=1e-4)
    assert native(torch.randn(0, 64), packed, scale, None).shape == (0, 32)


def test_pack_int8_roundtrip():
    q = torch.randint(-127, 128, (80, 7), dtype=torch.int8)
    packed = cpu_gemm_kernels.pack_int8(q)
    assert packed.shape == (5, 7, 16) and packed.dtype == torch.int8
    flat = packed.reshape(-1)
    assert flat[2 * 64 + 5] == q[5, 2]  # group 0 is [K, 64]: k = 2, row 5
    assert flat[64 * 7 + 3 * 16 + 9] == q[64 + 9, 3]  # the last group is [K, 16]
    assert torch.equal(cpu_gemm_kernels.unpack_int8(packed), q)


def test_quantization_error_bound():
    torch.manual_seed(0)
    w = torch.randn(64, 200) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different ranges
    w[3] = 0.0  # an all-zero row must not divide by zero
    q, scale = quant.quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (64,)
    assert q.abs().max() <= 127 and (q.abs().amax(dim=1)[scale != 1] == 127).all()
    error = (q.float() * scale[:, None] - w).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-5)).all()  # round to nearest: at most half a step
    assert torch.equal(q[3], torch.zeros_like(q[3]))


def test_linear_layer_quantizes_and_matches(native):
    layer = ColumnParallelLinear(64, 48, bias=True, quant_config=quant.Int8Config())
    torch.manual_seed(1)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.quant_method, quant.Int8LinearMethod)
    assert layer.weight.dtype == torch.int8 and layer.weight.shape == (3, 64, 16)
    x = torch.randn(3, 64)
    q, scale = quant.quantize_per_channel(w)
    torch.testing.assert_close(layer(x), F.linear(x, q.float() * scale[:, None], b), rtol=1e-4, atol=1e-4)
    # Against the float weight: the per-weight error of half a step, summed over 64 inputs.
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=0, atol=0.2)


def test_layer_the_kernel_cannot_take_stays_float(native):
    layer = ColumnParallelLinear(64, 40, bias=False, quant_config=quant.Int8Config())  # 40: not a multiple of 16
    with torch.no_grad():
        layer.weight.normal_()
    w = layer.weight.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float32 and layer.weight_scale is None
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_unknown_method_is_an_error():
    with pytest.raises(ValueError, match="quantization must be"):
        get_quantization_config("int3")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"quantization": "int3"}, "quantization must be None"),
        ({"quantization": "int8", "dtype": "bfloat16"}, "needs dtype float32"),
        ({"quantization": "w8a8", "device": "cuda"}, "runs on CPU only"),
    ],
)
def test_bad_options_are_value_errors(llama_model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(llama_model_dir), **kwargs).create_engine_config()


def test_cli_flag_reaches_engine_args():
    import argparse

    from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from_namespace(parser.parse_args(["--quantization", "int8"])).quantization == "int8"
    assert engine_args_from_namespace(parser.parse_args([])).quantization is None


# Greedy int8 vs fp32 on the tiny random llama. Its logits are flat (random weights), so steps
# whose two best fp32 tokens are within ~0.05 nats are common, and the int8 noise (measured over
# 6 prompts x 16 tokens: top-1 logprobs differ by 0.018 on average, 0.084 at most) can flip such a
# near-tie. So: tokens must match, with close logprobs, until the first step where fp32's top two
# are within LOGPROB_TOL; there int8 may pick fp32's runner-up. Measured: 3 of these 4 prompts
# match all 16 tokens, the fourth flips a 0.04-nat tie at its second token.
PROMPTS = ["Hello world", "The quick brown fox", "1 2 3 4", "abc def ghi"]
LOGPROB_TOL = 0.15


def test_engine_int8_greedy_tracks_fp32(llama_model_dir, native):
    from pagedllm import LLM, SamplingParams

    outputs = {}
    for method, top in ((None, 2), ("int8", 1)):
        llm = LLM(str(llama_model_dir), quantization=method)
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=top)
        outputs[method] = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm
    identical = 0
    for ref, got in zip(outputs[None], outputs["int8"]):
        for step, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
            if a != b:  # only a near-tie of fp32 may flip
                assert b in ref.logprobs[step], f"int8 picked {b}, not among fp32's top two"
                assert ref.logprobs[step][a].logprob - ref.logprobs[step][b].logprob < LOGPROB_TOL
                break
            assert abs(ref.logprobs[step][a].logprob - got.logprobs[step][b].logprob) < LOGPROB_TOL
        else:
            identical += 1
    assert identical >= 3, "int8 should reproduce fp32's first 8 greedy tokens on most prompts"
