"""The Triton int8 / int4 dequant-GEMMs against dequantize-then-matmul in float64, and the quant
methods holding the CUDA layouts: compiled on CUDA, in Triton's CPU interpreter otherwise
(TRITON_INTERPRET=1 set before triton is imported; the methods are told their CPU tensors are on
the Triton path). Interpreter shapes are small; the CUDA-only cases run Llama-sized ones."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from pagedllm.layers.quantization import int4, triton_layout
from tests.layers.int4_reference import as_tensor, pack_gptq_rows, random_int4
from tests.triton_kernels import import_kernels

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# bf16: the interpreter truncates the fp32 sums to bf16 (a GPU rounds), up to one bf16 step.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _import_kernels():
    kernels = import_kernels("pagedllm.layers.quantization.triton_dequant_gemm", CUDA)
    if not CUDA and not kernels.interpreting():
        pytest.skip(
            "triton was imported earlier in this process without TRITON_INTERPRET=1; run this file on its own",
            allow_module_level=True,
        )
    return kernels


gemm = _import_kernels()


@pytest.fixture
def triton_path(monkeypatch):
    """The quant methods take the Triton layouts on this device (CPU: under the interpreter)."""
    if not CUDA:
        monkeypatch.setattr(triton_layout, "triton_device", lambda device: True)


def _check(y: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == want.shape
    scale = want.abs().max().item()
    torch.testing.assert_close(y.cpu().double(), want, rtol=TOL[dtype], atol=TOL[dtype] * scale)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x @ W^T (+ bias) in float64 on x and the weights as rounded to ``dtype``."""
    y = x.to(dtype).double() @ w.to(dtype).double().t()
    return y if bias is None else y + bias.to(dtype).double()


def _int4_weights(n: int, k: int, group: int, seed: int = 0):
    q, scale, zero, _ = random_int4(n, k, group, np.random.default_rng(seed))
    return as_tensor(q), as_tensor(scale), as_tensor(zero).float()


# ------------------------------------------------------------------------------------------- int8
INT8_CASES = [(1, 37, 45), (5, 64, 96), (17, 40, 130), (70, 24, 33)]  # (M, N, K): odd edges, each tile row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k", INT8_CASES)
def test_int8_gemm_matches_dequantize_then_matmul(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) / (127 * k**0.5)
    x, bias = torch.randn(m, k, generator=gen), (torch.randn(n, generator=gen) if m % 2 else None)
    y = gemm.int8_gemm(x.to(DEVICE, dtype), triton_layout.pack_int8(q).to(DEVICE), scale.to(DEVICE), _on(bias, dtype))
    _check(y, _reference(x, q.double() * scale.double()[:, None], bias, dtype), dtype)


def _on(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(DEVICE, dtype)


# ------------------------------------------------------------------------------------------- int4
INT4_CASES = [  # (M, N, K, G): groups 32/64/128, K past the tile's step, a group no step divides
    (1, 37, 96, 32),
    (3, 24, 192, 64),
    (9, 40, 384, 128),
    (20, 16, 256, 128),
    (2, 8, 120, 40),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("zeros", [True, False], ids=["zero-points", "symmetric"])
@pytest.mark.parametrize("m,n,k,group", INT4_CASES)
def test_int4_gemm_matches_dequantize_then_matmul(m, n, k, group, zeros, dtype):
    q, scale, zero = _int4_weights(n, k, group, seed=m)
    if not zeros:
        zero = torch.full_like(zero, 8.0)
    x, bias = torch.randn(m, k, generator=torch.Generator().manual_seed(k)), torch.randn(n) if zeros else None
    s_k, z_k = triton_layout.int4_group_params(scale, zero)
    assert (z_k is None) == (not zeros)
    y = gemm.int4_gemm(
        x.to(DEVICE, dtype),
        triton_layout.pack_int4(q).to(DEVICE),
        s_k.to(DEVICE),
        None if z_k is None else z_k.to(DEVICE),
        _on(bias, dtype),
        group,
    )
    _check(y, _reference(x, int4.dequantize(q, scale, zero).double(), bias, dtype), dtype)


@pytest.mark.parametrize("tile", gemm.TILES, ids=lambda t: f"M<={t[0]}" if isinstance(t, tuple) else "")
def test_every_tile_of_the_table_gives_the_same_product(tile):
    """Each tile (decode to prefill), forced on a 3-row input: the masks and K steps, not M, differ."""
    m, n, k, group = 3, 40, 256, 64
    q, scale, zero = _int4_weights(n, k, group)
    x = torch.randn(m, k)
    s_k, z_k = triton_layout.int4_group_params(scale, zero)
    args = (triton_layout.pack_int4(q).to(DEVICE), s_k.to(DEVICE), z_k.to(DEVICE), None, group)
    y = gemm.int4_gemm(x.to(DEVICE), *args, tile=tile[1])
    _check(y, _reference(x, int4.dequantize(q, scale, zero).double(), None, torch.float32), torch.float32)


def test_tiles_grow_with_m_and_the_k_step_fits_the_group():
    assert gemm.tile_for(1).block_m == 16 and gemm.tile_for(4096).block_m == 128
    assert [gemm.tile_for(m).block_m for m in (16, 17, 64, 65, 256, 257)] == [16, 32, 32, 64, 64, 128]
    assert gemm.int4_block_k(128, 32) == 32 and gemm.int4_block_k(32, 128) == 32
    assert gemm.int4_block_k(128, 96) == 32 and gemm.int4_block_k(128, 40) == 128  # 40: no step of 16+


# ------------------------------------------------------------------------------------------- layouts
def test_int4_layout_is_gptqs_qweight_and_round_trips():
    q, _, _ = _int4_weights(24, 64, 32)
    packed = triton_layout.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (8, 24)
    assert torch.equal(packed, as_tensor(pack_gptq_rows(q.numpy().T)))
    assert torch.equal(triton_layout.unpack_int4(packed), q)
    with pytest.raises(ValueError, match="in_features % 8"):
        triton_layout.pack_int4(q[:, :60])


# ------------------------------------------------------------------------------------------- methods
def _build(make):
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return make()


@pytest.mark.parametrize("method,kw,symmetric", [("awq", {}, False), ("gptq", {}, False), ("gptq", {}, True)])
def test_checkpoint_layers_repack_into_the_cuda_layout(triton_path, method, kw, symmetric):
    """AWQ / GPTQ layers through their repack: the kernel's words (a GPTQ layer's own qweight),
    scales and zeros [K / G, N] (none when all are 8), and the product against numpy."""
    from pagedllm.layers.linear import QKVParallelLinear
    from tests.models.test_awq_gptq import _config, checkpoint_tensors

    rng = np.random.default_rng(0)
    layer = _build(lambda: QKVParallelLinear(64, 16, 4, 2, bias=True, quant_config=_config(method, 32, **kw)))
    qs, weights, stored = [], [], []
    for shard, n in zip(["q", "k", "v"], layer.output_sizes):
        q, scale, zero, g_idx = random_int4(n, 64, 32, rng)
        zero = np.full_like(zero, 8) if symmetric else zero
        qs.append(q)
        weights.append(int4.dequantize(as_tensor(q), as_tensor(scale), as_tensor(zero).float()))
        tensors = checkpoint_tensors(method, q, scale, zero, g_idx)
        stored.append(tensors["qweight"])
        for name, tensor in tensors.items():
            getattr(layer, name).weight_loader(getattr(layer, name), tensor, shard)
    layer.bias.data.copy_(torch.randn(128))
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.int32 and layer.weight.shape == (8, 128)
    assert torch.equal(layer.weight.cpu(), as_tensor(pack_gptq_rows(np.concatenate(qs).T)))
    if method == "gptq":
        assert torch.equal(layer.weight.cpu(), torch.cat(stored, dim=1))  # GPTQ's words, kept
    assert layer.weight_scale.shape == (2, 128) and (layer.weight_zero is None) == symmetric
    x = torch.randn(3, 64)
    _check(
        layer(x.to(DEVICE)), _reference(x, torch.cat(weights).double(), layer.bias.cpu(), torch.float32), torch.float32
    )


def test_int4_and_int8_quantize_any_out_features_on_the_triton_path(triton_path):
    """--quantization int4 / int8 on a layer of 40 outputs (the CPU kernels need % 16): quantized,
    not left float, and equal to the torch dequantization of the same codes."""
    from pagedllm.layers.linear import RowParallelLinear
    from pagedllm.layers.quantization.int4 import Int4Config, quantize_groupwise
    from pagedllm.layers.quantization.int8 import Int8Config, quantize_per_channel

    w, x = torch.randn(40, 128) / 12, torch.randn(5, 128)
    for config, dequantized in (
        (Int4Config(), int4.dequantize(*quantize_groupwise(w, 128))),
        (Int8Config(), (lambda q, s: q.float() * s[:, None])(*quantize_per_channel(w))),
    ):
        layer = _build(lambda config=config: RowParallelLinear(128, 40, quant_config=config))
        layer.weight.data.copy_(w)
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.weight.dtype in (torch.int32, torch.int8) and layer.weight.shape[1] == 40
        _check(layer(x.to(DEVICE)), _reference(x, dequantized.double(), None, torch.float32), torch.float32)


def test_w8a8_checkpoint_layers_run_weight_only_on_the_triton_path(triton_path, monkeypatch):
    """A W8A8 layer (compressed-tensors) where no W8A8 kernel exists (CUDA) keeps its exact Q and
    scales on the int8 weight-only kernel, activations float."""
    from pagedllm.layers.linear import RowParallelLinear
    from pagedllm.layers.quantization.int8 import Int8LinearMethod, quantize_per_channel
    from pagedllm.layers.quantization.prequantized import PrequantizedConfig, scaled_int8
    from pagedllm.layers.quantization.w8a8 import W8A8LinearMethod

    monkeypatch.setattr(W8A8LinearMethod, "can_take", lambda self, w: False)  # as on CUDA
    q, s = quantize_per_channel(torch.randn(40, 64))
    layer = _build(lambda: RowParallelLinear(64, 40, quant_config=PrequantizedConfig(None, W8A8LinearMethod)))
    layer.weight.weight_loader(layer.weight, scaled_int8(q, s))
    layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.quant_method, Int8LinearMethod) and layer.weight.shape == (64, 40)
    x = torch.randn(2, 64)
    _check(layer(x.to(DEVICE)), _reference(x, q.double() * s.double()[:, None], None, torch.float32), torch.float32)


def test_gpu_quantization_is_accepted_where_a_kernel_exists(llama_model_dir, monkeypatch):
    from pagedllm.config import EngineArgs
    from pagedllm.config import model as model_config

    config = EngineArgs(model=str(llama_model_dir), quantization="int4", device="cuda", dtype="bfloat16")
    assert config.create_engine_config().model_config.quantization == "int4"
    for quantization, match in (("w8a8", "runs on CPU only"), ("int8", "install triton")):
        if match == "install triton":
            monkeypatch.setattr(model_config, "triton_available", lambda: False)
        with pytest.raises(ValueError, match=match):
            EngineArgs(model=str(llama_model_dir), quantization=quantization, device="cuda").create_engine_config()


# ------------------------------------------------------------------------------------------- GPU only
@pytest.mark.skipif(not CUDA, reason="Llama-sized shapes and the engine on the Triton kernels need a GPU")
@pytest.mark.parametrize("m", [1, 16, 300])
def test_llama_sized_int4_and_int8_on_the_gpu(m):
    n, k, group, dtype = 4096, 4096, 128, torch.bfloat16
    q, scale, zero = _int4_weights(n, k, group)
    x = torch.randn(m, k)
    s_k, z_k = triton_layout.int4_group_params(scale, zero)
    y = gemm.int4_gemm(x.to(DEVICE, dtype), triton_layout.pack_int4(q).cuda(), s_k.cuda(), z_k.cuda(), None, group)
    _check(y, _reference(x, int4.dequantize(q, scale, zero).double(), None, dtype), dtype)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s8 = torch.rand(n) / (127 * k**0.5)
    y = gemm.int8_gemm(x.to(DEVICE, dtype), triton_layout.pack_int8(q8).cuda(), s8.cuda(), None)
    _check(y, _reference(x, q8.double() * s8.double()[:, None], None, dtype), dtype)


@pytest.mark.skipif(not CUDA, reason="the engine on the Triton kernels needs a GPU")
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_on_the_triton_kernels_tracks_the_cpu_kernels(llama_model_dir, method):
    """The same quantized codes (quantization is deterministic) on CUDA (Triton) and CPU (C++), in
    float32: each prompt's greedy tokens agree until a near-tie (<= 0.01 nats) of the CPU run."""
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    runs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(llama_model_dir), quantization=method, device=device, dtype="float32", enforce_eager=True)
        runs[device] = [o.outputs[0] for o in llm.generate(["Hello world", "1 2 3 4"], params, use_tqdm=False)]
        del llm
    for cpu, gpu in zip(runs["cpu"], runs["cuda"]):
        for step, (a, b) in enumerate(zip(cpu.token_ids, gpu.token_ids)):
            if a != b:
                assert cpu.logprobs[step][a].logprob - cpu.logprobs[step][b].logprob < 0.01
                break
            assert abs(cpu.logprobs[step][a].logprob - gpu.logprobs[step][b].logprob) < 1e-3


def test_the_kernels_compile_for_a_gpu_target():
    """The interpreter does not run Triton's compiler: build the kernels for sm_90 (no GPU needed)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    nvidia = importlib.util.find_spec("triton.backends.nvidia")
    bundled = nvidia is not None and (Path(str(nvidia.origin)).parent / "bin" / "ptxas").exists()
    if nvidia is None or not (bundled or shutil.which("ptxas")):
        pytest.skip("triton's CUDA backend (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-m", "tests.layers.compile_quant_gemm"], env=env, cwd=root, capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.count("ok ") == 5, run.stdout + run.stderr[-3000:]
