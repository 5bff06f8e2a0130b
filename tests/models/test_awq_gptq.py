"""AWQ and GPTQ checkpoints on the int4 kernel: the tests' own packers against the formats'
constants, each layer against numpy, a tiny llama end to end against transformers on the float
checkpoint holding the same dequantized weights, and the errors for configs that cannot run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.config import EngineArgs
from pagedllm.hf_config import load_arch_config
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import int4
from pagedllm.layers.quantization.awq import AWQConfig, unpack_columns
from pagedllm.layers.quantization.gptq import GPTQ_ORDER, GPTQConfig, v1_zero_words_to_v2
from pagedllm.models.loader import load_model
from tests.layers.int4_reference import (
    as_tensor,
    dequantize,
    pack_awq,
    pack_gptq_columns,
    pack_gptq_rows,
    random_int4,
    reference_linear,
)

pytestmark = pytest.mark.skipif(int4.load_int4_gemm() is None, reason="the C++ int4 kernel could not be built here")


def test_packers_match_the_formats_constants():
    values = np.arange(8, dtype=np.uint8)[None, :]
    assert pack_awq(values).view(np.uint32)[0, 0] == 0x75316420
    assert pack_gptq_rows(values.T).view(np.uint32)[0, 0] == 0x76543210
    assert pack_gptq_columns(values).view(np.uint32)[0, 0] == 0x76543210


def test_v1_zero_points_of_0_take_back_the_borrow():
    """A v1 word holds z - 1 per nibble, written by subtracting 0x11111111 from the v2 word: z = 0
    at nibble 0 stores 0xF there and borrows 1 from nibble 1 (its z = 5 stores 3, not 4)."""
    v2 = pack_gptq_columns(np.array([[0, 5, 0, 0, 15, 1, 0, 9]], dtype=np.uint8))
    v1 = (v2.view(np.uint32) - np.uint32(0x11111111)).view(np.int32)
    assert v1.view(np.uint32)[0, 0] == 0x7F0DEF3F
    zeros = unpack_columns(v1_zero_words_to_v2(as_tensor(v1)), GPTQ_ORDER)
    assert zeros.tolist() == [[0, 5, 0, 0, 15, 1, 0, 9]]


def checkpoint_tensors(method: str, q, scale, zero, g_idx, v1: bool = True) -> dict[str, torch.Tensor]:
    """One layer's tensors as the format stores them (transposed to [in, out])."""
    scales = as_tensor(scale.T).half()
    if method == "awq":
        return {"qweight": as_tensor(pack_awq(q.T)), "qzeros": as_tensor(pack_awq(zero.T)), "scales": scales}
    qzeros = pack_gptq_columns(zero.T)
    if v1:  # as GPTQModel exports v1: 0x11111111 off each whole word (a zero point of 0 borrows)
        qzeros = (qzeros.view(np.uint32) - np.uint32(0x11111111)).view(np.int32)
    return {
        "qweight": as_tensor(pack_gptq_rows(q.T)),
        "qzeros": as_tensor(qzeros),
        "scales": scales,
        "g_idx": as_tensor(g_idx),
    }


def _config(method: str, group: int, **kw: Any) -> Any:
    if method == "awq":
        return AWQConfig.from_config({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, **kw})
    return GPTQConfig.from_config({"quant_method": "gptq", "bits": 4, "group_size": group, **kw})


LAYER_CASES = [
    ("awq", {}, False),
    ("gptq", {}, False),
    ("gptq", {"checkpoint_format": "gptq_v2"}, False),
    ("gptq", {"desc_act": True}, True),
]


@pytest.mark.parametrize("method,kw,desc_act", LAYER_CASES, ids=["awq", "gptq", "gptq_v2", "gptq-desc_act"])
def test_fused_and_row_layers_match_numpy(method, kw, desc_act):
    rng = np.random.default_rng(0)
    config = _config(method, 32, **kw)
    qkv = QKVParallelLinear(64, 16, 4, 2, bias=True, quant_config=config)  # q 64, k 32, v 32 outputs
    gate_up = MergedColumnParallelLinear(96, [48, 48], quant_config=config)
    down = RowParallelLinear(128, 48, quant_config=config)
    v1 = kw.get("checkpoint_format", "gptq") == "gptq"
    for layer, shards in ((qkv, ["q", "k", "v"]), (gate_up, [0, 1]), (down, [None])):
        k, weights, bias = layer.input_size, [], rng.standard_normal(sum(layer.output_sizes)).astype(np.float32)
        g_idx = random_int4(8, k, 32, rng, desc_act)[3]  # one act-order for the layer's one input
        for shard, n in zip(shards, layer.output_sizes):
            q, scale, zero, _ = random_int4(n, k, 32, rng)
            weights.append(dequantize(q, scale, zero, g_idx))
            for name, tensor in checkpoint_tensors(method, q, scale, zero, g_idx, v1).items():
                param = getattr(layer, name)
                param.weight_loader(param, tensor, shard)
        if layer.bias is not None:
            layer.bias.data.copy_(as_tensor(bias))
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.weight.dtype == torch.uint8 and not hasattr(layer, "qweight")
        x = rng.standard_normal((3, k)).astype(np.float32)
        want = reference_linear(x, np.concatenate(weights), bias if layer.bias is not None else None)
        np.testing.assert_allclose(layer(as_tensor(x)).numpy(), want, rtol=1e-4, atol=1e-4)


# --- a tiny llama as an AWQ / GPTQ checkpoint, against transformers on the dequantized float one --

GROUP = 32
PROMPTS = [[1, 5, 9, 13], [5, 40, 80, 120, 160, 200], [7]]  # no pad token (HF would mask it)


def write_checkpoints(src: Path, root: Path, method: str, desc_act: bool = False, v1: bool = True, **config: Any):
    """(quantized dir, float dir): the float model's linears replaced by random int4 weights."""
    rng = np.random.default_rng(1)
    quant_dir, float_dir = root / "quantized", root / "float"
    for d in (quant_dir, float_dir):
        shutil.copytree(src, d)
    state = load_file(str(src / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    orders: dict[str, np.ndarray] = {}  # act-order: one per input, as GPTQ computes it from that input
    for name, tensor in state.items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            quantized[name] = tensor
            continue
        n, k = tensor.shape
        q, scale, zero, g_idx = random_int4(n, k, GROUP, rng, desc_act)
        g_idx = orders.setdefault(_input_of(name), g_idx)
        state[name] = as_tensor(dequantize(q, scale, zero, g_idx))
        prefix = name.removesuffix("weight")
        for key, value in checkpoint_tensors(method, q, scale, zero, g_idx, v1).items():
            quantized[prefix + key] = value
    save_file(state, str(float_dir / "model.safetensors"))
    save_file({k: v.clone() for k, v in quantized.items()}, str(quant_dir / "model.safetensors"))
    hf_config = json.loads((src / "config.json").read_text())
    hf_config["quantization_config"] = {
        "quant_method": method,
        "bits": 4,
        "group_size": GROUP,
        **({"zero_point": True, "version": "gemm"} if method == "awq" else {"desc_act": desc_act, "sym": False}),
        **config,
    }
    (quant_dir / "config.json").write_text(json.dumps(hf_config))
    return quant_dir, float_dir


def _input_of(name: str) -> str:
    """Projections that read the same input (q/k/v, gate/up) share it."""
    for fused in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        for part in fused:
            name = name.replace(part, fused[0])
    return name


CHECKPOINTS = {
    "awq": ("awq", {}),
    "gptq": ("gptq", {}),
    "gptq-v2-desc_act": ("gptq", {"desc_act": True, "v1": False, "checkpoint_format": "gptq_v2"}),
}


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_greedy_tokens_match_transformers_on_the_dequantized_float_model(llama_model_dir, tmp_path, case):
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    method, kw = CHECKPOINTS[case]
    quant_dir, float_dir = write_checkpoints(llama_model_dir, tmp_path, method, **kw)
    hf = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32)
    llm = LLM(str(quant_dir), kv_cache_memory=0.05, max_model_len=128)
    assert llm.llm_engine.config.model_config.quantization == method
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    assert sum(getattr(m, "weight", None) is not None and m.weight.dtype == torch.uint8 for m in model.modules()) == 8
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt) :].tolist()
    stack = model.model.decode_stack()
    if stack is not None and kw.get("desc_act"):  # the C++ decode stack gathers act-order inputs itself
        assert all(p is not None for p in stack.perms)


# --- bad configs: clear ValueErrors -------------------------------------------------------------


def _load(model_dir: Path) -> None:
    load_model(
        str(model_dir),
        load_arch_config(model_dir),
        dtype=torch.float32,
        device=torch.device("cpu"),
        quantization=json.loads((model_dir / "config.json").read_text())["quantization_config"]["quant_method"],
    )


@pytest.mark.parametrize(
    "config,match",
    [
        ({"bits": 3}, "bits=3 are not supported"),
        ({"bits": 8}, "bits=8 are not supported"),
        ({"group_size": 48}, "group_size 48 does not divide a layer's in_features 64"),
        ({"group_size": 16}, "cannot load checkpoint tensor .*qzeros"),  # tensors written for groups of 32
        ({"checkpoint_format": "marlin"}, "checkpoint_format must be one of"),
        ({"is_marlin_format": True}, "marlin's repacked layout"),
        ({"lm_head": True}, "quantized LM head"),
    ],
)
def test_bad_gptq_configs_are_value_errors(llama_model_dir, tmp_path, config, match):
    quant_dir, _ = write_checkpoints(llama_model_dir, tmp_path, "gptq", **config)
    with pytest.raises(ValueError, match=match):
        _load(quant_dir)


def test_bad_awq_config_and_shape_mismatch_are_value_errors(llama_model_dir, tmp_path):
    quant_dir, _ = write_checkpoints(llama_model_dir, tmp_path / "zp", "awq", zero_point=False)
    with pytest.raises(ValueError, match="zero_point: false"):
        _load(quant_dir)
    quant_dir, _ = write_checkpoints(llama_model_dir, tmp_path / "skip", "awq", modules_to_not_convert=["down_proj"])
    with pytest.raises(ValueError, match="modules_to_not_convert"):
        _load(quant_dir)
    quant_dir, _ = write_checkpoints(llama_model_dir, tmp_path / "shape", "awq")
    hf_config = json.loads((quant_dir / "config.json").read_text())
    hf_config["intermediate_size"] = 256  # the checkpoint's mlp is 128 wide
    (quant_dir / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ValueError, match="cannot load checkpoint tensor"):
        _load(quant_dir)


def test_quantization_option_must_agree_with_the_checkpoint(llama_model_dir, tmp_path):
    quant_dir, float_dir = write_checkpoints(llama_model_dir, tmp_path, "awq")
    engine_config = EngineArgs(model=str(quant_dir)).create_engine_config()
    assert engine_config.model_config.quantization == "awq"
    for wrong in ("gptq", "int4"):
        with pytest.raises(ValueError, match=f"quantization='{wrong}' disagrees .*quant_method 'awq'"):
            EngineArgs(model=str(quant_dir), quantization=wrong).create_engine_config()
    with pytest.raises(ValueError, match="config.json has no quantization_config"):
        EngineArgs(model=str(float_dir), quantization="awq").create_engine_config()
    hf_config = json.loads((quant_dir / "config.json").read_text())
    hf_config["quantization_config"]["quant_method"] = "squeezellm"
    (quant_dir / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ValueError, match="'squeezellm' is not supported"):
        EngineArgs(model=str(quant_dir)).create_engine_config()


@pytest.mark.parametrize("group", [32, -1], ids=["group32", "one-group"])
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_tp2_shards_of_packed_tensors_match_the_unsharded_layer(method, group):
    """Each rank's shard of the packed tensors equals the unsharded layer's; with one group per
    row (-1) the row-parallel layer's single scale / zero column goes whole to every rank."""
    from tests.layers.test_tp_shards import tp_rank

    rng = np.random.default_rng(3)
    config = _config(method, group)
    g = 128 if group == -1 else group
    g_idx = np.arange(128) // g
    x = rng.standard_normal((2, 128)).astype(np.float32)
    parts = {p: random_int4(n, 128, g, rng) for p, n in (("q", 64), ("k", 32), ("v", 32))}
    want = {p: reference_linear(x, dequantize(*parts[p][:3], g_idx)) for p in parts}
    down = random_int4(48, 128, g, rng)
    for rank in range(2):
        with tp_rank(rank, 2):
            qkv = QKVParallelLinear(128, 16, 4, 2, quant_config=config)
            row = RowParallelLinear(128, 48, quant_config=config)
        for p, (q, scale, zero, _) in parts.items():
            for name, tensor in checkpoint_tensors(method, q, scale, zero, g_idx).items():
                getattr(qkv, name).weight_loader(getattr(qkv, name), tensor, p)
        for name, tensor in checkpoint_tensors(method, *down[:3], g_idx).items():
            getattr(row, name).weight_loader(getattr(row, name), tensor)
        for layer in (qkv, row):
            layer.quant_method.process_weights_after_loading(layer)
        got = qkv(as_tensor(x)).numpy()
        halves = [want["q"][:, 32 * rank : 32 * (rank + 1)], *(want[p][:, 16 * rank : 16 * (rank + 1)] for p in "kv")]
        np.testing.assert_allclose(got, np.concatenate(halves, axis=1), rtol=1e-4, atol=1e-4)
        partial = row(as_tensor(x[:, 64 * rank : 64 * (rank + 1)])).numpy()
        down_part = reference_linear(
            x[:, 64 * rank : 64 * (rank + 1)], dequantize(*down[:3], g_idx)[:, 64 * rank : 64 * (rank + 1)]
        )
        np.testing.assert_allclose(partial, down_part, rtol=1e-4, atol=1e-4)
