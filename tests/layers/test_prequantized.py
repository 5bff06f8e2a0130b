"""Pre-quantized checkpoint formats, one linear layer at a time: the tensors our packer writes
(``tests/quant_checkpoints.py``) go through the format's checkpoint conversion and the layer's
loader, and the layer's output is checked against x @ W^T with W dequantized exactly (numpy).

Bounds: a format that is already int8 per channel loads exactly (float rounding only); one that
is requantized to int8 per channel moves each weight by at most half its row's step (scale / 2),
so each output may move by at most sum_k |x_k| * scale_n / 2 (checked per element). W8A8 layers
quantize the activations per token too: their reference is the quantized x times the exact W."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.layers.cpu_gemm_kernels import unpack_int8
from pagedllm.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import get_quantization_config
from pagedllm.layers.quantization.bitsandbytes import CodebookInt4Method, dequantize_4bit
from pagedllm.layers.quantization.int4 import load_int4_table_gemm
from pagedllm.layers.quantization.int8 import Int8LinearMethod, load_int8_gemm
from pagedllm.layers.quantization.int8_groups import GroupedInt8Method
from pagedllm.layers.quantization.w8a8 import W8A8LinearMethod, quantize_per_token, unpack_w8a8
from tests import quant_checkpoints as qc

W8A8 = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
INT_CHANNEL = {"type": "int", "strategy": "channel"}


def ct(fmt: str, weights: dict, activations: dict | None = None) -> dict:
    group: dict = {"targets": ["Linear"], "weights": {"num_bits": 8, "symmetric": True, **weights}}
    if activations:
        group["input_activations"] = activations
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


def bnb4(kind: str) -> dict:
    return {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": kind}


# name -> (quantization_config, packer, exact: loads without requantizing)
FORMATS = {
    "fp8-block": ({"quant_method": "fp8", "weight_block_size": [16, 32]}, qc.fp8((16, 32)), False),
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, qc.fp8(None, "weight_scale"), False),
    # Not exact: W8A8's kernel takes the -128 codes as -127 (test_w8a8_keeps_the_checkpoint_codes).
    "ct-w8a8": (ct("int-quantized", INT_CHANNEL, W8A8), qc.int8_channel(), False),
    "ct-w8a16-packed": (ct("pack-quantized", INT_CHANNEL), qc.int8_channel(packed=True), True),
    # Exact: int8 groups with zero points as stored (PrequantizedGroupedMethod).
    "ct-w8a16-packed-asym": (
        ct("pack-quantized", {"type": "int", "strategy": "group", "group_size": 16, "symmetric": False}),
        qc.int8_channel(symmetric=False, group_size=16, packed=True),
        True,
    ),
    "ct-w8a16-group-asym": (
        ct("naive-quantized", {"type": "int", "strategy": "group", "group_size": 16, "symmetric": False}),
        qc.int8_channel(symmetric=False, group_size=16),
        True,
    ),
    "ct-fp8-channel": (
        ct("float-quantized", {"type": "float", "strategy": "channel"}),
        qc.fp8("channel", "weight_scale"),
        False,
    ),
    "ct-fp8-block": (
        ct("float-quantized", {"type": "float", "strategy": "block", "block_structure": [16, 32]}),
        qc.fp8((16, 32), "weight_scale"),
        False,
    ),
    "bnb-int8": ({"quant_method": "bitsandbytes", "load_in_8bit": True}, qc.bnb_int8, True),
    # Exact: the codes run on the int4 kernel with the code table (bitsandbytes.CodebookInt4Method).
    "bnb-nf4-nested": (bnb4("nf4"), qc.bnb_4bit("nf4", nested=True), True),
    "bnb-fp4": (bnb4("fp4"), qc.bnb_4bit("fp4", nested=False), True),
}


def _stream(prefix: str, parts: dict[str, torch.Tensor]):
    # Scales first: a layer's tensors may come in any order.
    return iter(sorted(((f"{prefix}.{s}", t) for s, t in parts.items()), key=lambda kv: "scale" not in kv[0]))


def _loaded_layer(config, layer, packed: dict[str, dict[str, torch.Tensor]]):
    """Feed each shard's converted tensors through the layer's loader, then process."""
    for shard, parts in packed.items():
        for name, tensor in config.convert_checkpoint(_stream(f"m.{shard}", parts)):
            assert name == f"m.{shard}.weight"
            layer.weight.weight_loader(layer.weight, tensor, None if shard == "o" else shard)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_qkv_layer_matches_the_exact_dequantized_weights(fmt: str) -> None:
    quant_config, pack, exact = FORMATS[fmt]
    config = get_quantization_config(quant_config["quant_method"], quant_config)
    torch.manual_seed(0)
    layer = QKVParallelLinear(64, 16, 4, 2, quant_config=config)  # q 64 rows, k and v 32 each
    weights = {s: torch.randn(n, 64) / 8 for s, n in (("q", 64), ("k", 32), ("v", 32))}
    packed = {s: pack(w) for s, w in weights.items()}
    _loaded_layer(config, layer, {s: p[0] for s, p in packed.items()})
    w = np.concatenate([packed[s][1] for s in "qkv"])
    _check(layer, w, exact)


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-w8a8", "bnb-nf4-nested", "ct-w8a16-group-asym"])
def test_row_parallel_layer_with_odd_sizes(fmt: str) -> None:
    """48 inputs: blocks and 4-bit bytes that do not divide the rows evenly."""
    quant_config, pack, exact = FORMATS[fmt]
    config = get_quantization_config(quant_config["quant_method"], quant_config)
    layer = RowParallelLinear(96, 48, quant_config=config)
    stored, w = pack(torch.randn(48, 96, generator=torch.Generator().manual_seed(1)) / 8)
    _check(_loaded_layer(config, layer, {"o": stored}), w, exact)


def _check(layer, w: np.ndarray, exact: bool) -> None:
    if isinstance(layer.quant_method, CodebookInt4Method):  # 4-bit codes on the int4 kernel
        assert layer.weight.dtype == torch.uint8
    elif load_int8_gemm() is not None:  # with the kernels built, the layer runs int8 (no float fallback)
        assert isinstance(layer.quant_method, (Int8LinearMethod, W8A8LinearMethod, GroupedInt8Method))
        assert layer.weight.dtype == torch.int8
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(2))
    got = layer(x)
    if isinstance(layer.quant_method, W8A8LinearMethod):
        qx, sx = quantize_per_token(x)
        x = qx.float() * sx[:, None]  # what the kernel multiplies
    want = x @ torch.from_numpy(w).float().T
    step = torch.from_numpy(np.abs(w).max(axis=1) / 127).float()
    bound = 1e-4 + (0 if exact else x.abs() @ torch.ones(w.shape[1], 1) * step / 2)
    assert ((got - want).abs() <= bound + 1e-3 * want.abs()).all(), (got - want).abs().max()


def test_symmetric_int8_per_channel_keeps_the_checkpoint_codes() -> None:
    """compressed-tensors' symmetric int8 (scale = absmax / 127.5) stores -128 where a row's largest
    weight is negative: W8A16 keeps every code and scale as stored, W8A8 the same but -128 as -127."""
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(5)) / 8
    stored, _ = qc.int8_channel()(w)
    q, scale = stored["weight"], stored["weight_scale"]
    assert bool((q == -128).any())
    for fmt, want in (("ct-w8a16-packed", q), ("ct-w8a8", q.clamp(min=-127))):
        quant_config = FORMATS[fmt][0]
        config = get_quantization_config(quant_config["quant_method"], quant_config)
        parts = FORMATS[fmt][1](w)[0]
        layer = _loaded_layer(config, RowParallelLinear(64, 32, quant_config=config), {"o": parts})
        if isinstance(layer.quant_method, W8A8LinearMethod):
            assert torch.equal(unpack_w8a8(layer.weight, 64), want)
        elif load_int8_gemm() is not None:
            assert torch.equal(unpack_int8(layer.weight), want)
        assert torch.equal(layer.weight_scale, scale.reshape(-1))


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
def test_4bit_dequantize_matches_bitsandbytes(kind: str, nested: bool) -> None:
    """Our reading of the serialized NF4 / FP4 state equals bitsandbytes' own dequantize. (Rows
    of 128: bitsandbytes 0.50's CPU dequantize disagrees with its own quantize when a row is not a
    multiple of the block, e.g. [48, 80], off by up to 1.7 where ours stays within the code step.)"""
    bnb = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(3))
    q, state = bnb.quantize_4bit(w, blocksize=64, quant_type=kind, compress_statistics=nested)
    parts = {"weight": q, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    torch.testing.assert_close(dequantize_4bit("m", parts), bnb.dequantize_4bit(q, state), rtol=0, atol=1e-6)


def test_a_layer_the_checkpoint_left_float_is_quantized_on_arrival_and_the_head_stays_float() -> None:
    """A linear in the ignore list arrives float: in the layers' int8 groups (FP8's: of 32, as the
    requantized FP8 layers are). A quantized LM head (not in the ignore list) is widened back to float32."""
    from pagedllm.layers.embedding import ParallelLMHead
    from pagedllm.layers.quantization.int8_groups import dequantize_groups, quantize_groups

    quant_config, pack, _ = FORMATS["fp8-block"]
    config = get_quantization_config("fp8", quant_config)
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(4))
    layer = RowParallelLinear(96, 48, quant_config=config)
    (name, tensor), *rest = config.convert_checkpoint(iter([("m.weight", w)]))
    assert name == "m.weight" and tensor is w and not rest  # passed through untouched
    layer.weight.weight_loader(layer.weight, tensor)
    layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.quant_method, GroupedInt8Method) and layer.quant_method.group_size == 32
    x = torch.randn(3, 96)
    torch.testing.assert_close(layer(x), x @ dequantize_groups(*quantize_groups(w, 32)).T, rtol=1e-4, atol=1e-4)

    head = ParallelLMHead(48, 96, quant_config=config)
    stored, deq = pack(torch.randn(48, 96) / 8)
    [(_, scaled)] = config.convert_checkpoint(_stream("lm_head", stored))
    head.weight.weight_loader(head.weight, scaled)
    assert head.weight.dtype == torch.float32
    step = torch.from_numpy(np.abs(deq).max(axis=1) / 127).float()
    assert ((head.weight.data - torch.from_numpy(deq)).abs() <= step[:, None] / 2 + 1e-6).all()


def _bnb4_layer(kind: str, layer, parts: dict[str, torch.Tensor]):
    config = get_quantization_config("bitsandbytes", bnb4(kind))
    for _, tensor in config.convert_checkpoint(_stream("m", parts)):
        layer.weight.weight_loader(layer.weight, tensor, None)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", [64, 128, 256])
def test_4bit_layer_runs_bitsandbytes_own_weights_exactly(kind: str, blocksize: int) -> None:
    """bitsandbytes' own quantize_4bit (its serialized state): the layer keeps the codes (half a
    byte a weight on the int4 kernel with the code table) and computes x @ W^T for W its own
    dequantize_4bit, to float rounding. Blocks of 128 and 256 are groups of 64 with repeated scales."""
    bnb = pytest.importorskip("bitsandbytes.functional")
    if load_int4_table_gemm() is None:
        pytest.skip("the C++ kernels are not built here")
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(6))
    q, state = bnb.quantize_4bit(w, blocksize=blocksize, quant_type=kind, compress_statistics=True)
    parts = {"weight": q, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    config = get_quantization_config("bitsandbytes", bnb4(kind))
    layer = _bnb4_layer(kind, RowParallelLinear(256, 96, quant_config=config), parts)
    assert isinstance(layer.quant_method, CodebookInt4Method) and layer.quant_method.group_size == 64
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() == 96 * 256 // 2
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    want = x.double() @ bnb.dequantize_4bit(q, state).double().T
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def test_4bit_layer_falls_back_where_the_kernel_cannot_take_it() -> None:
    """40 outputs (not a multiple of the kernels' 16): dequantized and requantized per channel as
    the other requantized formats are (which then runs as float32, as int8 would here)."""
    config = get_quantization_config("bitsandbytes", bnb4("nf4"))
    stored, w = qc.bnb_4bit("nf4", nested=False)(torch.randn(40, 64, generator=torch.Generator().manual_seed(8)))
    layer = _bnb4_layer("nf4", RowParallelLinear(64, 40, quant_config=config), stored)
    assert not isinstance(layer.quant_method, CodebookInt4Method) and layer.weight.dtype != torch.uint8
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    want = x @ torch.from_numpy(w).T
    bound = 1e-4 + x.abs() @ torch.ones(64, 1) * torch.from_numpy(np.abs(w).max(axis=1) / 127) / 2
    assert ((layer(x) - want).abs() <= bound).all()


def test_4bit_layer_errors_name_the_cause() -> None:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(9))
    config = get_quantization_config("bitsandbytes", bnb4("nf4"))
    fp4_parts, _ = qc.bnb_4bit("fp4", nested=False)(w)
    with pytest.raises(ValueError, match="a fp4 weight in a checkpoint whose .* says bnb_4bit_quant_type 'nf4'"):
        _bnb4_layer("nf4", RowParallelLinear(64, 32, quant_config=config), fp4_parts)
    small_blocks, _ = qc.bnb_4bit("nf4", nested=False, blocksize=32)(w)
    with pytest.raises(ValueError, match="blocks of 32 values .* blocks of 64 values or a multiple"):
        _bnb4_layer("nf4", RowParallelLinear(64, 32, quant_config=config), small_blocks)


def test_4bit_fused_layer_quantizes_a_float_shard_to_the_table() -> None:
    """A shard the checkpoint left float (beside 4-bit ones) is quantized as bitsandbytes would:
    absmax per group of 64, nearest table value; the layer computes with exactly those weights."""
    from pagedllm.layers.quantization.bitsandbytes import NF4_TABLE, quantize_to_table

    config = get_quantization_config("bitsandbytes", bnb4("nf4"))
    layer = QKVParallelLinear(64, 16, 4, 2, quant_config=config)
    weights = {s: torch.randn(n, 64, generator=torch.Generator().manual_seed(10 + n)) / 8 for s, n in (("q", 64), ("k", 32), ("v", 32))}  # fmt: skip
    packed = {s: qc.bnb_4bit("nf4", nested=True)(weights[s]) for s in "qv"}
    for shard in "qkv":
        if shard == "k":
            stream = config.convert_checkpoint(iter([("m.k.weight", weights["k"])]))
        else:
            stream = config.convert_checkpoint(_stream(f"m.{shard}", packed[shard][0]))
        for _, tensor in stream:
            layer.weight.weight_loader(layer.weight, tensor, shard)
    layer.quant_method.process_weights_after_loading(layer)
    codes, scale = quantize_to_table(weights["k"], 64, torch.tensor(NF4_TABLE))
    k_w = (torch.tensor(NF4_TABLE)[codes.long()] * scale).numpy()
    assert np.abs(k_w - weights["k"].numpy()).max() <= 0.2 * np.abs(weights["k"].numpy()).max()
    _check(layer, np.concatenate([packed["q"][1], k_w, packed["v"][1]]), exact=True)


@pytest.mark.parametrize("fmt", ["ct-w8a16-group-asym", "fp8-block"])
def test_grouped_layers_fall_back_where_the_group_op_cannot_take_them(fmt: str) -> None:
    """40 outputs (not a multiple of the kernels' 16): the groups dequantized and requantized per
    channel, then float32 as int8 is here; within the per-channel bound."""
    quant_config, pack, _ = FORMATS[fmt]
    config = get_quantization_config(quant_config["quant_method"], quant_config)
    stored, w = pack(torch.randn(40, 64, generator=torch.Generator().manual_seed(11)) / 8)
    layer = _loaded_layer(config, RowParallelLinear(64, 40, quant_config=config), {"o": stored})
    assert not isinstance(layer.quant_method, GroupedInt8Method)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    want = x @ torch.from_numpy(w).float().T
    bound = 1e-4 + x.abs() @ torch.ones(64, 1) * torch.from_numpy(np.abs(w).max(axis=1) / 127).float()
    assert ((layer(x) - want).abs() <= bound).all()


def test_compressed_int8_groups_keep_their_codes_and_zero_points() -> None:
    """An asymmetric group-wise W8A16 layer holds the checkpoint's int8 codes, scales and zero
    points as they are (no requantization)."""
    from pagedllm.layers.cpu_gemm_kernels import unpack_int8

    quant_config, pack, _ = FORMATS["ct-w8a16-group-asym"]
    config = get_quantization_config("compressed-tensors", quant_config)
    stored, _ = pack(torch.randn(32, 64, generator=torch.Generator().manual_seed(12)) / 8)
    layer = _loaded_layer(config, RowParallelLinear(64, 32, quant_config=config), {"o": stored})
    if not isinstance(layer.quant_method, GroupedInt8Method):
        pytest.skip("the C++ kernels are not built here")
    assert layer.quant_method.group_size == 16
    assert torch.equal(unpack_int8(layer.weight), stored["weight"])
