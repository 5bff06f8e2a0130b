"""compressed-tensors W4A16 (pack-quantized int4, symmetric or with zero points) on the int4 kernel:
the packing against its definition, fused and row-parallel layers against an exact numpy
dequantize-then-matmul, a tiny llama end to end against transformers on the float checkpoint
holding the same dequantized weights, and the schemes it refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import int4
from pagedllm.layers.quantization.compressed_tensors import parse_compressed_tensors
from tests import quant_checkpoints as qc
from tests.engine_checks import assert_idle_and_intact
from tests.layers.int4_reference import reference_linear
from tests.lora.conftest import hf_greedy

pytestmark = pytest.mark.skipif(int4.load_int4_gemm() is None, reason="the C++ int4 kernel could not be built here")


def pack_int4_words(q: np.ndarray) -> torch.Tensor:
    """compressed-tensors' packing: eight values per int32 along the input dim, lowest bits first,
    each signed value q in -8..7 stored as q + 8."""
    u = (q.astype(np.int64) + 8).reshape(q.shape[0], -1, 8)
    words = (u << (4 * np.arange(8))).sum(axis=2)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def pack_zero_words(zp: np.ndarray) -> torch.Tensor:
    """compressed-tensors' zero points [N, G]: eight per int32 along the output dim (dim 0),
    lowest bits first, each stored as zp + 8 -> [N / 8, G]."""
    return pack_int4_words(zp.T).T.contiguous()


def w4a16(group: int | None, symmetric: bool = True):
    """int4 per group of ``group`` inputs (None: per channel); asymmetric as compressed-tensors
    quantizes it: the range [min(w, 0), max(w, 0)] in 16 steps, zp = round(-8 - lo / scale)."""

    def pack(w: torch.Tensor):
        x = w.numpy()
        g = group or x.shape[1]
        blocks = x.reshape(x.shape[0], -1, g)
        if symmetric:
            scale = np.maximum(np.abs(blocks).max(axis=2), 1e-12) / 7
        else:
            lo, hi = np.minimum(blocks.min(axis=2), 0), np.maximum(blocks.max(axis=2), 0)
            scale = np.maximum(hi - lo, 1e-12) / 15
        scale = scale.astype(np.float16).astype(np.float32)  # as stored (fp16)
        zp = np.zeros_like(scale) if symmetric else np.clip(np.round(-8 - lo / scale), -8, 7)
        q = np.clip(np.round(blocks / scale[..., None] + zp[..., None]), -8, 7)
        deq = ((q - zp[..., None]) * scale[..., None]).reshape(x.shape).astype(np.float32)
        parts = {
            "weight_packed": pack_int4_words(q.reshape(x.shape)),
            "weight_scale": torch.from_numpy(scale).half(),
            "weight_shape": torch.tensor(list(x.shape)),
        }
        if not symmetric:
            parts["weight_zero_point"] = pack_zero_words(zp)
        return parts, deq

    return pack


def config(group: int | None, symmetric: bool = True, **weights) -> dict:
    scheme = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group" if group else "channel"}
    if group:
        scheme["group_size"] = group
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**scheme, **weights}}},
        "ignore": ["lm_head"],
    }


def test_packed_word_holds_inputs_lowest_bits_first():
    words = pack_int4_words(np.arange(-8, 8, dtype=np.int64)[None, :]).numpy().view(np.uint32)
    assert words.tolist() == [[0x76543210, 0xFEDCBA98]]
    zeros = pack_zero_words(np.arange(-8, 8, dtype=np.int64)[:, None]).numpy().view(np.uint32)
    assert zeros.tolist() == [[0x76543210], [0xFEDCBA98]]  # rows 0-7, then 8-15


SCHEMES = {
    "group16": (16, True),
    "channel": (None, True),
    "asym-group16": (16, False),
    "asym-channel": (None, False),
}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fused_and_row_layers_match_numpy(scheme):
    """Each projection's tensors loaded through the layers' shard loaders (the zero points packed
    down the rows cut at each projection's N / 8), against (q - zp) * s in numpy."""
    group, symmetric = SCHEMES[scheme]
    quant_config = parse_compressed_tensors(config(group, symmetric))
    gen = torch.Generator().manual_seed(0)
    qkv = QKVParallelLinear(64, 16, 4, 2, quant_config=quant_config)  # q 64, k 32, v 32 outputs
    gate_up = MergedColumnParallelLinear(96, [48, 48], quant_config=quant_config)
    down = RowParallelLinear(128, 48, quant_config=quant_config)
    for layer, shards in ((qkv, ["q", "k", "v"]), (gate_up, [0, 1]), (down, [None])):
        dequantized = []
        for shard, n in zip(shards, layer.output_sizes):
            parts, deq = w4a16(group, symmetric)(torch.randn(n, layer.input_size, generator=gen))
            dequantized.append(deq)
            for suffix, tensor in parts.items():
                if suffix != "weight_shape":
                    param = getattr(layer, suffix)
                    param.weight_loader(param, tensor, shard)
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.weight.dtype == torch.uint8 and not hasattr(layer, "weight_zero_point")
        x = torch.randn(3, layer.input_size, generator=gen).numpy()
        want = reference_linear(x, np.concatenate(dequantized))
        np.testing.assert_allclose(layer(torch.from_numpy(x)).numpy(), want, rtol=1e-4, atol=1e-4)


# actorder "weight" ordered only the calibration: plain consecutive groups, no g_idx stored.
@pytest.mark.parametrize(("scheme", "extra"), [*((s, {}) for s in SCHEMES), ("group16", {"actorder": "weight"})])
def test_w4a16_greedy_equals_transformers_on_the_dequantized_weights(llama_model_dir, tmp_path, scheme, extra):
    group, symmetric = SCHEMES[scheme]
    quant = config(group, symmetric, **extra)
    oracle = qc.write_checkpoint(llama_model_dir, tmp_path / "w4a16", quant, w4a16(group, symmetric))
    llm = LLM(str(tmp_path / "w4a16"), kv_cache_memory=0.05, max_model_len=128)
    assert llm.llm_engine.config.model_config.quantization == "compressed-tensors"
    prompts = [[5, 17, 42, 99, 7], [300, 2, 2, 8, 64, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == [hf_greedy(Path(oracle), None, p, 8) for p in prompts]
    assert_idle_and_intact(llm)


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({"actorder": "group"}, "actorder"),
        ({"actorder": "group", "symmetric": False}, "actorder"),
        ({"strategy": "tensor"}, "strategy 'group' with a positive group_size, or 'channel'"),
    ],
)
def test_w4a16_schemes_the_kernel_cannot_run_are_refused(llama_model_dir, tmp_path, weights, match):
    qc.write_checkpoint(llama_model_dir, tmp_path / "bad", config(16, **weights), w4a16(16))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "bad"), kv_cache_memory=0.05)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"format": "naive-quantized"}, "must be stored pack-quantized"),
        ({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "leaves linears unquantized"),
        ({"ignore": []}, "LM head is 4-bit too"),
    ],
)
def test_w4a16_layouts_the_int4_layers_cannot_hold_are_refused(llama_model_dir, tmp_path, change, match):
    qc.write_checkpoint(llama_model_dir, tmp_path / "bad", {**config(16), **change}, w4a16(16))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "bad"), kv_cache_memory=0.05)
