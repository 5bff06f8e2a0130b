"""W8A8 (``--quantization w8a8``): the kernel (csrc/cpu_gemm_w8a8.cpp) on every level and dot
path against exact integer math on the same quantized operands, the quantizers' error bounds,
the layer and the LM head, and the engine end to end against fp32."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pagedllm import cpu_info
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.quantization import building_with, w8a8
from pagedllm.layers.quantization.int8 import quantize_per_channel

# Rows: every tile height of every path (1-6) and remainders, a decode batch, a prefill block; the
# amx path (from 16 rows) in 32-row blocks of two 16-row tiles: one full tile, a part of the
# second, both, and a block holding 2.
ROWS = [1, 2, 3, 4, 5, 6, 7, 16, 20, 32, 64, 130]
# (out, in): one panel; 4 panels + 2 (a 6-wide vnni512 remainder) with K % 4 == 1; 5 panels
# (4 + 1) with K % 4 == 3; 7 panels (4 + 3) with a wide K; K < 4.
SHAPES = [(16, 8), (96, 33), (80, 130), (112, 1539), (48, 3)]


def _reference(x, q, w_scale, bias):
    """(qx qw^T) sx sw + b in float64 with the kernel's activation quantization."""
    qx, sx = w8a8.quantize_per_token(x)
    acc = qx.reshape(-1, x.shape[-1]).double() @ q.double().T  # exact: every sum < 2^53
    y = acc * sx.reshape(-1, 1).double() * w_scale.double()
    y = y if bias is None else y + bias.double()
    return y.reshape(*x.shape[:-1], q.shape[0])


def _operands(rows, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 1, rows)[:, None]  # rows of different ranges
    x[rows // 2] = 0.0  # an all-zero token: scale 1, q 0, output = bias
    q, scale = quantize_per_channel(torch.randn(n, k, generator=gen))
    return x, q, scale, torch.randn(n, generator=gen)


def _assert_exact(y, reference):
    # The kernel's int32 sum is exact; float32 rounding of it and of sx * sw leaves ~3e-7 relative.
    torch.testing.assert_close(y.double(), reference, rtol=1e-6, atol=1e-6 * reference.abs().max().item())


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_every_level_and_path_is_exact(isa_ops, rows, n, k):
    x, q, scale, bias = _operands(rows, n, k, seed=rows * 7919 + n * 31 + k)
    packed, comp = w8a8.pack_w8a8(q), w8a8.compensation(q)
    reference = _reference(x, q, scale, bias)
    paths = isa_ops.w8a8_paths()
    assert paths, "every build compiles at least one path"
    for path in range(len(paths)):
        y = isa_ops.linear_w8a8(x, packed, scale, comp, bias, path)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        _assert_exact(y, reference)
        torch.testing.assert_close(y[rows // 2], bias)  # the zero token


# Per level: (the dot-product extension's path, the path without it).
PATHS = {"avx512": ("vnni512", "maddubs512"), "avx2": ("vnni256", "maddubs256"), "neon": ("dotprod", "mull")}


def test_each_build_compiles_its_dot_paths(isa_ops):
    level = isa_ops.name.removeprefix("pagedllm_")
    if level == "portable":
        assert isa_ops.w8a8_paths() == ["scalar"]
        return
    best, fallback = PATHS[level]
    amx = ["amx"] if cpu_info.amx_int8(level) else []  # chosen at run time: the CPU and the OS allow it
    assert isa_ops.w8a8_paths() == (amx + [best, fallback] if cpu_info.dot_extension(level) else [fallback])


def test_amx_path_can_be_turned_off(isa_ops):
    if not cpu_info.amx_int8(isa_ops.name.removeprefix("pagedllm_")):
        pytest.skip("no AMX path on this CPU / build")
    code = "from pagedllm.layers import cpu_kernels; print(','.join(cpu_kernels.cpu_ops('avx512').w8a8_paths()))"
    env = {**os.environ, "PAGEDLLM_AMX": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "vnni512,maddubs512"


def test_batched_input_empty_input_and_bad_arguments(isa_ops):
    x, q, scale, bias = _operands(6, 32, 20, seed=1)
    xb = x.reshape(2, 3, 20)
    packed, comp = w8a8.pack_w8a8(q), w8a8.compensation(q)
    y = isa_ops.linear_w8a8(xb, packed, scale, comp, None, 0)
    assert y.shape == (2, 3, 32)
    _assert_exact(y, _reference(xb, q, scale, None))
    strided = torch.randn(20, 5).t()  # rows with feature stride != 1
    _assert_exact(isa_ops.linear_w8a8(strided, packed, scale, comp, bias, 0), _reference(strided, q, scale, bias))
    assert isa_ops.linear_w8a8(torch.randn(0, 20), packed, scale, comp, None, 0).shape == (0, 32)
    with pytest.raises(RuntimeError, match="features"):
        isa_ops.linear_w8a8(torch.randn(2, 24), packed, scale, comp, None, 0)
    with pytest.raises(RuntimeError, match="path must be"):
        isa_ops.linear_w8a8(x, packed, scale, comp, None, len(isa_ops.w8a8_paths()))


def test_pack_roundtrip_and_layout():
    q = torch.randint(-127, 128, (32, 7), dtype=torch.int8)
    packed = w8a8.pack_w8a8(q)
    assert packed.shape == (2, 2, 16, 4) and packed.dtype == torch.int8
    assert packed[1, 1, 5, 2] == q[16 + 5, 4 + 2]  # panel 1, k4 step 1, output 5, k offset 2
    assert packed[0, 1, 3, 3] == 0  # K padded from 7 to 8 with zeros
    assert torch.equal(w8a8.unpack_w8a8(packed, 7), q)
    assert torch.equal(w8a8.compensation(q), 128 * q.int().sum(1))
    with pytest.raises(ValueError, match="out_features % 16"):
        w8a8.pack_w8a8(torch.zeros(40, 8, dtype=torch.int8))


def test_per_token_quantization_error_bound():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 300) * torch.logspace(-4, 2, 6)[:, None]
    x[1, 2] = 0.0
    q, scale = w8a8.quantize_per_token(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.shape == (4, 6)
    nonzero = x.abs().amax(-1) > 0
    assert (q.abs().amax(-1)[nonzero] == 127).all() and q.abs().max() <= 127
    error = (q.float() * scale[..., None] - x).abs()
    assert (error <= scale[..., None] / 2 * (1 + 1e-5)).all()  # round to nearest: half a step
    assert scale[1, 2] == 1 and not q[1, 2].any()
    with pytest.raises(ValueError, match="float32"):
        w8a8.quantize_per_token(x.double())


@pytest.fixture(scope="module")
def native():
    op = w8a8.load_w8a8_gemm()
    if op is None:
        pytest.skip("the C++ W8A8 kernel could not be built here")
    return op


def test_linear_layer_quantizes_and_tracks_float(native):
    layer = ColumnParallelLinear(576, 96, bias=True, quant_config=w8a8.W8A8Config())
    torch.manual_seed(1)
    with torch.no_grad():
        layer.weight.normal_(std=0.05)
        layer.bias.normal_()
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.quant_method, w8a8.W8A8LinearMethod)
    assert layer.weight.shape == (6, 144, 16, 4) and layer.weight_comp.dtype == torch.int32
    x = torch.randn(5, 576)
    q, scale = quantize_per_channel(w)
    _assert_exact(layer(x), _reference(x, q, scale, b))
    # Against float: measured relative error ~0.7% (weights and activations each within half a step).
    float_out = F.linear(x, w, b)
    assert ((layer(x) - float_out).norm() / float_out.norm()).item() < 0.02


def test_layer_the_kernel_cannot_take_stays_float(native, caplog):
    layer = ColumnParallelLinear(64, 40, bias=False, quant_config=w8a8.W8A8Config())  # 40: not a multiple of 16
    with torch.no_grad():
        layer.weight.normal_()
    w = layer.weight.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    assert "w8a8 quantization skipped" in caplog.text
    assert layer.weight.dtype == torch.float32 and layer.weight_scale is None
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_the_lm_head_is_w8a8_and_embedding_lookups_stay_float(native):
    with building_with(w8a8.W8A8Config()):
        embed = VocabParallelEmbedding(96, 64)
        head = ParallelLMHead(96, 64)
    torch.manual_seed(1)
    embed.weight.data.normal_()
    head.tie_weights(embed)
    table = embed.weight.data.clone()
    head.quant_method.process_weights_after_loading(head)
    assert isinstance(head.quant_method, w8a8.W8A8LinearMethod)
    assert head.weight.dtype == torch.int8 and head.weight.shape == (6, 16, 16, 4)
    assert embed.weight.dtype == torch.float32 and torch.equal(embed.weight.data, table)  # lookups unchanged
    x = torch.randn(3, 64)
    q, scale = quantize_per_channel(table)
    _assert_exact(head(x), _reference(x, q, scale, None))
    exact = x @ table.T
    assert ((head(x) - exact).norm() / exact.norm()).item() < 0.02  # near the float head
    head.quant_method.process_weights_after_loading(head)  # once only
    assert head.weight.shape == (6, 16, 16, 4)


# Engine, tiny random llama: 20 prompts of 3-40 tokens generated together (decode steps of up to
# 20 rows, prefills of several hundred), then each sequence scored teacher-forced by both engines.
# Measured relative logits error per position: median 0.030, max 0.064 (random weights give flat
# logits, so this is far above the real model's, see benchmarks/w8a8_accuracy.py); bounds 2x.
REL_MEDIAN_BOUND = 0.06
REL_MAX_BOUND = 0.13


def test_engine_w8a8_tracks_fp32_and_frees_its_blocks(llama_model_dir, native):
    from benchmarks.w8a8_accuracy import teacher_forced_logits
    from pagedllm import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (3 + 2 * i,), generator=gen).tolist() for i in range(20)]
    engines = {m: LLM(str(llama_model_dir), quantization=m) for m in (None, "w8a8")}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = engines["w8a8"].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = engines["w8a8"].llm_engine
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    errors = []
    for prompt, out in zip(prompts, outputs):
        assert len(out.outputs[0].token_ids) == 12
        seq = prompt + list(out.outputs[0].token_ids)
        fp32, w8 = (teacher_forced_logits(engines[m], seq) for m in (None, "w8a8"))
        errors.append((w8 - fp32).norm(dim=-1) / fp32.norm(dim=-1))
    engine.check_integrity()
    rel = torch.cat(errors)
    print(f"w8a8 logits relative error: median {rel.median():.4f}, max {rel.max():.4f}")
    assert rel.median() < REL_MEDIAN_BOUND and rel.max() < REL_MAX_BOUND
