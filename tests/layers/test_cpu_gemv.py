"""The packed-weight CPU GEMM kernel (csrc/cpu_gemm.cpp) against F.linear, and how the linear
layers pick it up or fall back."""

import logging

import pytest
import torch
import torch.nn.functional as F
import torch.utils.cpp_extension

from pagedllm.layers import cpu_gemm_kernels as kernels
from pagedllm.layers import cpu_kernels
from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.quantization import unquantized
from pagedllm.layers.quantization.unquantized import PACKED, choose_layout

# Row counts cover every tile height (1-6), several tiles, and the x-block split (K=1536: 130 rows
# are two blocks of 66 + 64).
ROWS = [0, 1, 2, 3, 4, 5, 6, 7, 13, 64, 130]
# (out, in): one panel, a 4-panel group plus a remainder, an odd K, a wide K.
SHAPES = [(16, 1), (96, 64), (48, 33), (80, 1536)]


@pytest.fixture(scope="module")
def native():
    op = kernels.load_cpu_gemm()
    if op is None:
        pytest.skip("the C++ GEMM kernel could not be built here")
    return op


def _check(op, rows, n, k, with_bias):
    torch.manual_seed(rows * 1000 + n + k)
    w, x = torch.randn(n, k), torch.randn(rows, k)
    b = torch.randn(n) if with_bias else None
    torch.testing.assert_close(op(x, kernels.pack_weight(w), b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_native_matches_f_linear(native, rows, n, k):
    _check(native, rows, n, k, with_bias=rows % 2 == 1)


# Every level's tiles (cpu_gemm_common.h): heights 1 to the tallest (6 on avx512 and avx2, 3 on
# portable) and a tile plus a remainder; 130 and 200 rows at K=1535: two and three x blocks (66 + 64,
# 72 + 72 + 56 rows), so the next group's prefetch crosses blocks. Widths: groups of 4, 3, 2 and 1 panels (96 = 4 + 2, 48 = 3,
# 80 = 4 + 1), which each level cuts into its tiles of 1-4 panels; odd K everywhere.
ISA_ROWS = [1, 2, 3, 4, 5, 6, 7, 13, 64, 130, 200]
ISA_SHAPES = [(16, 1), (96, 63), (48, 33), (80, 1535)]


@pytest.mark.parametrize("n,k", ISA_SHAPES)
@pytest.mark.parametrize("rows", ISA_ROWS)
def test_every_isa_matches_f_linear(isa_ops, rows, n, k):
    _check(isa_ops.packed_linear.default, rows, n, k, with_bias=True)


# 16-bit weights (--dtype bfloat16 / float16) in the same panels: one row, the tallest tile, a
# tile plus one row, and two x blocks at K=1535 (130 rows).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(96, 63), (80, 1535)])
@pytest.mark.parametrize("rows", [1, 6, 7, 130])
def test_every_isa_16_bit_weights(isa_ops, rows, n, k, dtype):
    """Widened exactly and summed in float32: against the float32 product of the same values,
    rounded once to the input's dtype (or kept float32 for a float32 input)."""
    torch.manual_seed(rows + n + k)
    w, x, b = torch.randn(n, k).to(dtype), torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
    exact = x.float() @ w.float().T + b.float()
    y = isa_ops.packed_linear_16.default(x, kernels.pack_weight(w), b)
    assert y.dtype == dtype
    # One rounding to dtype; near zero, the float32 sums' own error (K up to 1535 terms) shows.
    torch.testing.assert_close(y.float(), exact.to(dtype).float(), rtol=torch.finfo(dtype).eps, atol=1e-4)
    y32 = isa_ops.packed_linear_16.default(x.float(), kernels.pack_weight(w), None)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32, exact - b.float(), rtol=1e-5, atol=1e-4)


def test_smollm_shapes_across_threads(native):
    # Real sizes: many panels split over the threads, K=576 and 1536.
    for n, k in [(960, 576), (576, 1536), (3072, 576)]:
        for rows in (1, 4, 16):
            _check(native, rows, n, k, with_bias=False)


@pytest.mark.parametrize("panels", [10, 12, 14])
@pytest.mark.parametrize("rows", [5, 7, 13, 19, 64])
def test_thread_splits_and_prefetch(native, rows, panels):
    # K=1024: a panel is 64 KB, so every panel may go to its own thread; split over 2 threads, each
    # thread's last tile is 1, 2 or 3 panels wide. 2, 3, 4 and 11 row tiles share out the next
    # group's k steps to prefetch (the first few of them, each tile a slice spread over its K steps);
    # 5 rows are one row tile, whose narrow (avx2) tiles prefetch one tile ahead up to the thread's
    # last panel.
    _check(native, rows, 16 * panels, 1024, with_bias=True)


@pytest.mark.parametrize("rows", [7, 19, 64])
def test_every_isa_thread_splits_and_prefetch(isa_ops, rows):
    # The same on every ISA level's tiles (AVX2's and NEON's 1-panel row tiles split each row
    # tile's slice of the next group four ways).
    _check(isa_ops.packed_linear.default, rows, 16 * 14, 1024, with_bias=True)


def test_batched_and_strided_inputs(native):
    w = torch.randn(32, 64)
    x = torch.randn(5, 3, 64)
    packed = kernels.pack_weight(w)
    torch.testing.assert_close(native(x, packed, None), F.linear(x, w))
    xt = x.transpose(0, 1)  # rows not evenly strided: copied, same answer
    torch.testing.assert_close(native(xt, packed, None), F.linear(xt, w))
    wide = torch.randn(4, 128)[:, :64]  # rows strided, last dim contiguous: read in place
    torch.testing.assert_close(native(wide, packed, None), F.linear(wide, w))


def test_pack_roundtrip():
    w = torch.randn(48, 7)
    packed = kernels.pack_weight(w)
    assert packed.shape == (3, 7, 16) and packed[1, 2, 5] == w[21, 2]
    assert torch.equal(kernels.unpack_weight(packed), w)


def test_bad_inputs_are_errors(native):
    packed = kernels.pack_weight(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="features"):
        native(torch.randn(2, 9), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        native(torch.randn(2, 8), packed, torch.randn(15))
    native_16 = kernels.load_cpu_gemm_16()
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        native_16(torch.randn(2, 8), packed, None)
    with pytest.raises(RuntimeError, match="features"):
        native_16(torch.randn(2, 9), packed.bfloat16(), None)


def processed_layer(w: torch.Tensor) -> ColumnParallelLinear:
    """A linear layer holding ``w`` [out, in], its weights processed as the loader does."""
    layer = ColumnParallelLinear(w.shape[1], w.shape[0])
    layer.weight.data.copy_(w)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def test_linear_layer_uses_the_packed_layout(native):
    layer = ColumnParallelLinear(64, 96, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    dense = layer.weight.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.shape == (6, 64, 16) and layer.quant_method.layout is PACKED
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, dense, layer.bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("native_16_bit", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_layers_use_the_16_bit_panels(native, monkeypatch, dtype, native_16_bit):
    """A bfloat16 / float16 model's linears keep their dtype in the packed panels; where the CPU
    has native dot products of the dtype, batches from NATIVE_16_BIT_ROWS rows run oneDNN on a
    copy unpacked for the call."""
    monkeypatch.setattr(unquantized.cpu_info, "native_16_bit", lambda name: native_16_bit)
    w, b = torch.randn(48, 40).to(dtype), torch.randn(48).to(dtype)
    layer = ColumnParallelLinear(40, 48, bias=True)  # then holding what a 16-bit model loads
    layer.weight, layer.bias = (torch.nn.Parameter(t.clone(), requires_grad=False) for t in (w, b))
    layer.quant_method.process_weights_after_loading(layer)
    expected = unquantized.PACKED_16_SPLIT if native_16_bit else unquantized.PACKED_16
    assert layer.quant_method.layout is expected and layer.weight.shape == (3, 40, 16) and layer.weight.dtype == dtype
    for rows in (1, unquantized.NATIVE_16_BIT_ROWS + 3):
        x = torch.randn(rows, 40).to(dtype)
        y = layer(x)
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), (x.float() @ w.float().T + b.float()), rtol=2**-6, atol=2**-6)


def test_odd_out_features_keep_the_old_layout(native):
    w = torch.randn(20, 8)  # 20 % 16 != 0: oneDNN / column-major
    layer = processed_layer(w)
    assert layer.weight.dim() == 2
    x = torch.randn(2, 8)
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-4, atol=1e-4)


@pytest.fixture
def fresh_loader():
    cached = (kernels.load_cpu_gemm, kernels.load_cpu_gemm_16, cpu_kernels.build_cpu_library)
    for loader in cached:
        loader.cache_clear()
    yield
    for loader in cached:
        loader.cache_clear()


@pytest.mark.parametrize("switch", ["PAGEDLLM_CPU_KERNELS", "PAGEDLLM_CPU_GEMM"])
def test_env_var_turns_the_kernel_off(fresh_loader, monkeypatch, switch):
    monkeypatch.setenv(switch, "0")
    assert kernels.load_cpu_gemm() is None and kernels.load_cpu_gemm_16() is None
    assert choose_layout(torch.randn(32, 8)) is not PACKED
    assert choose_layout(torch.randn(32, 8).bfloat16()) is unquantized.COLUMN_MAJOR
    assert processed_layer(torch.randn(32, 8)).weight.dim() == 2


def test_failed_build_falls_back_with_a_warning(fresh_loader, monkeypatch, caplog, tmp_path):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no c++ compiler")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # no finished build to load
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert kernels.load_cpu_gemm() is None
    assert "no c++ compiler" in caplog.text
    w = torch.randn(32, 8)
    x = torch.randn(2, 8)
    torch.testing.assert_close(processed_layer(w)(x), F.linear(x, w), rtol=1e-4, atol=1e-4)
