"""compressed-tensors W4A16 (pack-quantized, symmetric int4) on the int4 kernel: the packing against
its definition, a tiny llama end to end against transformers on the float checkpoint holding the
same dequantized weights, and the schemes it refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.quantization import int4
from tests import quant_checkpoints as qc
from tests.engine_checks import assert_idle_and_intact
from tests.lora.conftest import hf_greedy

pytestmark = pytest.mark.skipif(int4.load_int4_gemm() is None, reason="the C++ int4 kernel could not be built here")


def pack_int4_words(q: np.ndarray) -> torch.Tensor:
    """compressed-tensors' packing: eight values per int32 along the input dim, lowest bits first,
    each signed value q in -8..7 stored as q + 8."""
    u = (q.astype(np.int64) + 8).reshape(q.shape[0], -1, 8)
    words = (u << (4 * np.arange(8))).sum(axis=2)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def w4a16(group: int | None):
    """Symmetric int4, per group of ``group`` inputs (None: per channel)."""

    def pack(w: torch.Tensor):
        x = w.numpy()
        g = group or x.shape[1]
        blocks = x.reshape(x.shape[0], -1, g)
        scale = (np.maximum(np.abs(blocks).max(axis=2), 1e-12) / 7).astype(np.float16).astype(np.float32)
        q = np.clip(np.round(blocks / scale[..., None]), -8, 7)  # the scale as stored (fp16)
        deq = (q * scale[..., None]).reshape(x.shape).astype(np.float32)
        parts = {
            "weight_packed": pack_int4_words(q.reshape(x.shape)),
            "weight_scale": torch.from_numpy(scale.astype(np.float32)).half(),
            "weight_shape": torch.tensor(list(x.shape)),
        }
        return parts, deq

    return pack


def config(group: int | None, **weights) -> dict:
    scheme = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group" if group else "channel"}
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


@pytest.mark.parametrize("group", [16, None], ids=["group16", "channel"])
def test_w4a16_greedy_equals_transformers_on_the_dequantized_weights(llama_model_dir, tmp_path, group):
    oracle = qc.write_checkpoint(llama_model_dir, tmp_path / "w4a16", config(group), w4a16(group))
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
        ({"symmetric": False}, "asymmetric 4-bit weights"),
        ({"actorder": "group"}, "actorder"),
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
    ],
)
def test_w4a16_layouts_the_int4_layers_cannot_hold_are_refused(llama_model_dir, tmp_path, change, match):
    qc.write_checkpoint(llama_model_dir, tmp_path / "bad", {**config(16), **change}, w4a16(16))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "bad"), kv_cache_memory=0.05)
