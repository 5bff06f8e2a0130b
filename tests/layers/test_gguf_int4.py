"""GGUF's 4-bit linears on the int4 kernel (``layers/quantization/gguf.py``): Q4_0 / Q4_1 / Q4_K
blocks repack to (q, scale, zero) that dequantize to what gguf-py decodes; Q8_0, the 5- and 6-bit
types and layers mixing block types stay int8 groups; a fused layer with a float part runs as float, and a GGUF model loads 4-bit by default with the
greedy tokens of transformers' own (dequantizing) GGUF loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.linear import MergedColumnParallelLinear
from pagedllm.layers.quantization import building_with, int8_groups
from pagedllm.layers.quantization.gguf import (
    INT8_SUFFIXES,
    IQ4_SUFFIXES,
    IQ4_TABLE,
    Q4_SUFFIXES,
    Q8_SUFFIXES,
    GGUFConfig,
    GGUFLinearMethod,
    blocks_to_int8,
    iq4_to_codes,
    q4_to_int4,
    q8_to_int8,
)
from pagedllm.layers.quantization.int4 import Int4KernelMethod, dequantize
from pagedllm.layers.quantization.int8_groups import GroupedInt8HeadMethod, GroupedInt8Method
from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagedllm.layers.quantization.w4a8 import W4A8LinearMethod

gguf = pytest.importorskip("gguf")
from gguf.constants import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402


def _weights(rows: int = 16, cols: int = 256) -> np.ndarray:
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    w[0, :32] = 0.0  # a zero group (scale 0)
    w[1, 32:64] = 0.75  # a constant group
    return w


def _repacked(raw: np.ndarray, qtype: str) -> np.ndarray:
    q, scale, zero, offset = q4_to_int4(raw, qtype)
    groups = (raw.shape[0], q.shape[1] // 32)
    assert q.dtype == np.uint8 and q.max() <= 15 and scale.shape == zero.shape == offset.shape == groups
    got = dequantize(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero)).numpy()
    # The offsets' form W = q * s + b is the same weights (b: the file's value, exact for Q4_0 / Q4_1).
    as_offsets = q.astype(np.float32) * np.repeat(scale, 32, axis=1) + np.repeat(offset, 32, axis=1)
    np.testing.assert_allclose(as_offsets, got, rtol=0, atol=1e-6 * max(1.0, float(np.abs(got).max())))
    return got


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_0_and_q4_1_repack_to_the_dequantized_weights(qtype: str) -> None:
    raw = gguf_quantize(_weights(), GGMLQuantizationType[qtype])
    want = gguf_dequantize(raw, GGMLQuantizationType[qtype])
    got = _repacked(raw, qtype)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    assert np.array_equal(got[0, :32], want[0, :32]) and np.array_equal(got[1, 32:64], want[1, 32:64])


def test_q4_k_repacks_to_the_dequantized_weights() -> None:
    # Random Q4_K blocks (144 bytes per 256 values): finite d / dmin, any 6-bit scales and nibbles.
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(8 * 2, 144), dtype=np.uint8)
    blocks[:, 0:4] = np.frombuffer(
        rng.uniform(0.001, 0.05, size=(16, 2)).astype(np.float16).tobytes(), np.uint8
    ).reshape(16, 4)
    blocks[0, 0:2] = 0  # d = 0: every group of the block is constant (-dmin * min)
    raw = blocks.reshape(8, 2 * 144)  # 8 rows of 512 values
    want = gguf_dequantize(raw, GGMLQuantizationType.Q4_K)
    got = _repacked(raw, "Q4_K")
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    assert np.array_equal(got[0, :256], want[0, :256])


def _random_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks of a K-quant gguf-py cannot write (any bits, sane float16 scales)."""
    size, headers = {
        "Q4_K": (144, (0, 2)),
        "Q5_K": (176, (0, 2)),
        "Q6_K": (210, (208,)),
        "Q3_K": (110, (108,)),
        "Q2_K": (84, (80, 82)),
        "IQ4_NL": (18, (0,)),
        "IQ4_XS": (136, (0,)),
    }[qtype]
    per_block = 32 if qtype == "IQ4_NL" else 256
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // per_block, size), dtype=np.uint8)
    for at in headers:
        d = rng.uniform(0.001, 0.05, size=blocks.shape[0]).astype(np.float16)
        blocks[:, at : at + 2] = np.frombuffer(d.tobytes(), np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K"])
def test_2_3_5_and_6_bit_types_repack_to_int8_groups_of_16(qtype: str) -> None:
    if qtype.endswith("_K"):
        raw = _random_blocks(qtype, 8, 512, seed=3)
    else:
        raw = gguf_quantize(_weights(8, 512), GGMLQuantizationType[qtype])
    want = gguf_dequantize(raw, GGMLQuantizationType[qtype])
    q, scale, zero = blocks_to_int8(raw, qtype)
    assert q.dtype == np.int8 and scale.shape == zero.shape == (8, 512 // 16)
    got = int8_groups.dequantize_groups(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero)).numpy()
    if qtype in ("Q5_0", "Q6_K", "Q3_K"):  # symmetric: the file's integers times its scales, bitwise
        assert np.array_equal(got, want) and not zero.any()
    else:  # an offset: the zero point is offset / scale (float rounding)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_iq4_codes_and_scales_are_what_gguf_py_decodes(qtype: str) -> None:
    """Random blocks (every code and 6-bit scale): table[code] * scale equals gguf-py, bitwise."""
    raw = _random_blocks(qtype, 8, 512, seed=4)
    codes, scale = iq4_to_codes(raw, qtype)
    assert codes.dtype == np.uint8 and codes.max() <= 15 and scale.shape == (8, 512 // 32)
    got = np.array(IQ4_TABLE, dtype=np.float32)[codes] * np.repeat(scale, 32, axis=1)
    assert np.array_equal(got, gguf_dequantize(raw, GGMLQuantizationType[qtype]))


def _layer(parts: list[str], x: torch.Tensor) -> tuple[MergedColumnParallelLinear, torch.Tensor]:
    """gate/up of 32 outputs each over 256 inputs, each part given as GGUF blocks of a type
    ("q4": Q4_0, "q41": Q4_1, "q8": Q8_0, "q5": Q5_1, "q6k": Q6_K) streamed as the loader streams them, or
    as a float tensor; returns the layer after loading and the reference ``x @ W.T`` of the
    dequantized weights."""
    with building_with(GGUFConfig()):
        layer = MergedColumnParallelLinear(256, [32, 32], bias=False)
    params = dict(layer.named_parameters())
    reference = []
    qtypes = {
        "q3k": "Q3_K",
        "q2k": "Q2_K",
        "q4": "Q4_0",
        "q41": "Q4_1",
        "q8": "Q8_0",
        "q5": "Q5_1",
        "q6k": "Q6_K",
        "iq4nl": "IQ4_NL",
        "iq4xs": "IQ4_XS",
    }
    for shard, (kind, w) in enumerate(zip(parts, np.split(_weights(64, 256), 2))):
        if kind == "float":
            params["weight"].weight_loader(params["weight"], torch.from_numpy(w), shard)
            reference.append(w)
            continue
        qtype = qtypes[kind]
        raw = (
            _random_blocks(qtype, 32, 256, shard)
            if qtype in ("Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS")
            else gguf_quantize(w, GGMLQuantizationType[qtype])
        )
        if kind in ("q4", "q41"):
            names, values = Q4_SUFFIXES, q4_to_int4(raw, qtype)
        elif kind.startswith("iq4"):
            names, values = IQ4_SUFFIXES, iq4_to_codes(raw, qtype)
        elif kind == "q8":
            names, values = Q8_SUFFIXES, q8_to_int8(raw)
        else:
            names, values = INT8_SUFFIXES, blocks_to_int8(raw, qtype)
        for name, part in zip(names, values):
            params[name].weight_loader(params[name], torch.from_numpy(part), shard)
        reference.append(gguf_dequantize(raw, GGMLQuantizationType[qtype]))
    layer.quant_method.process_weights_after_loading(layer)
    return layer, x @ torch.from_numpy(np.concatenate(reference)).T


def test_a_layer_of_4bit_parts_runs_the_int4_kernel_and_mixed_parts_run_float() -> None:
    x = torch.randn(3, 256)
    layer, want = _layer(["q4", "q4"], x)
    assert isinstance(layer.quant_method, GGUFLinearMethod) and layer.weight.dtype == torch.uint8
    assert not hasattr(layer, "gguf_q")
    # Q4_0's scales are the file's float16 d and its zero point 8: held as float16 (pack_group_params).
    assert layer.weight_scale.dtype == layer.weight_zero.dtype == torch.float16
    assert not layer.quant_method.zero_offset
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)  # the kernel's own summation order
    # Q4_1: its zero point -m / d is no float16, so the layer holds the file's d and m (W = d q + m).
    layer, want = _layer(["q41", "q41"], x)
    assert layer.quant_method.zero_offset and layer.weight_scale.dtype == layer.weight_zero.dtype == torch.float16
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)
    layer, want = _layer(["q4", "float"], x)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)  # fp32 GEMM vs torch: summation order


@pytest.mark.parametrize(
    "parts,group,zero",
    [
        (["q8", "q8"], 32, False),  # Q8_0 throughout: its blocks of 32, no zero point
        (["q6k", "q6k"], 16, False),  # Q6_K: groups of 16, symmetric
        (["q4", "q6k"], 16, True),  # a Q4_K_M-like qkv: 4-bit parts with a Q6_K part
        (["q8", "q4"], 16, True),
        (["q5", "q8"], 16, True),
        (["q3k", "q3k"], 16, False),  # Q3_K: its 3-bit values and 6-bit scales, symmetric
        (["q2k", "q3k"], 16, True),  # Q2_K's offsets: zero points (a Q2_K file mixes the two)
    ],
)
def test_block_types_other_than_4bit_stay_int8_groups(parts: list[str], group: int, zero: bool) -> None:
    x = torch.randn(3, 256)
    layer, want = _layer(parts, x)
    method = layer.quant_method
    assert isinstance(method, GroupedInt8Method) and layer.weight.dtype == torch.int8 and method.group_size == group
    assert (layer.weight_zero is not None) == zero
    if parts == ["q8", "q8"]:  # Q8_0's float16 d as it is
        assert layer.weight_scale.dtype == torch.float16
    assert not any(hasattr(layer, name) for name in (*Q4_SUFFIXES, *Q8_SUFFIXES, *INT8_SUFFIXES))
    # The file's values, the kernel's sums (random Q6_K blocks reach |w| ~ 200: a relative bound).
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("parts", [["iq4nl", "iq4nl"], ["iq4xs", "iq4nl"]])
def test_iq4_layers_run_the_int4_kernel_with_the_table(parts: list[str]) -> None:
    """IQ4_NL / IQ4_XS parts stay 4-bit: their codes on the table op, the file's weights."""
    x = torch.randn(3, 256)
    layer, want = _layer(parts, x)
    method = layer.quant_method
    assert isinstance(method, GGUFLinearMethod) and method.code_table and layer.weight.dtype == torch.uint8
    assert layer.weight.numel() == 64 * 256 // 2 and not any(hasattr(layer, name) for name in IQ4_SUFFIXES)
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_iq4_beside_another_block_type_joins_the_int8_groups_exactly() -> None:
    x = torch.randn(3, 256)
    layer, want = _layer(["iq4xs", "q8"], x)
    assert isinstance(layer.quant_method, GroupedInt8Method) and layer.weight_zero is None  # both symmetric
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_a_float_part_makes_the_layer_float() -> None:
    x = torch.randn(3, 256)
    for parts in (["float", "q8"], ["q6k", "float"]):
        layer, want = _layer(parts, x)
        assert isinstance(layer.quant_method, UnquantizedLinearMethod)
        torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_a_layer_missing_a_part_names_it() -> None:
    with building_with(GGUFConfig()):
        layer = MergedColumnParallelLinear(64, [32, 32], bias=False)
    weight = dict(layer.named_parameters())["weight"]
    weight.weight_loader(weight, torch.zeros(32, 64), 0)
    with pytest.raises(ValueError, match=r"no tensor for part\(s\) \[1\] of a linear layer with outputs \[32, 32\]"):
        layer.quant_method.process_weights_after_loading(layer)


def _write_q4_1(llama_model_dir: Path, out: Path, head_quant: str | None) -> Path:
    from safetensors.torch import load_file

    from pagedllm.entrypoints.bench.gguf_export import write_gguf
    from pagedllm.hf_config import load_hf_config

    state: dict[str, Any] = {}
    for f in sorted(llama_model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return write_gguf(state, load_hf_config(llama_model_dir), out, quant="Q4_1", head_quant=head_quant)


@pytest.fixture(scope="module")
def q4_1_gguf(llama_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q4_1 linears, the LM head float32."""
    return _write_q4_1(llama_model_dir, tmp_path_factory.mktemp("gguf-q4") / "tiny-Q4_1.gguf", None)


@pytest.fixture(scope="module")
def q4_1_q8_head_gguf(llama_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q4_1 linears, the LM head Q8_0 (as llama-quantize writes SmolLM2's)."""
    return _write_q4_1(llama_model_dir, tmp_path_factory.mktemp("gguf-q4-q8") / "tiny-Q4_1.gguf", "Q8_0")


def _model(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.executor.worker.model_runner.model  # type: ignore[attr-defined]


def _linear_methods(llm: LLM) -> set[type]:
    return {type(m.quant_method) for m in _model(llm).model.layers.modules() if hasattr(m, "quant_method")}


def test_a_q4_1_gguf_loads_4bit_by_default_with_transformers_greedy_tokens(
    q4_1_gguf: Path, llama_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [[5, 17, 99, 3, 250], [42, 7, 7, 300, 11, 64, 2]]
    hf = AutoModelForCausalLM.from_pretrained(str(q4_1_gguf.parent), gguf_file=q4_1_gguf.name, dtype=torch.float32)
    llm = LLM(str(q4_1_gguf), tokenizer=str(llama_model_dir), kv_cache_memory=0.05, max_model_len=128)
    assert llm.llm_engine.config.model_config.quantization == "gguf"
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt) :].tolist()
    assert _linear_methods(llm) == {GGUFLinearMethod} and issubclass(GGUFLinearMethod, Int4KernelMethod)
    assert isinstance(_model(llm).lm_head.quant_method, UnquantizedLinearMethod)  # the file's head is F32
    floats = LLM(str(q4_1_gguf), tokenizer=str(llama_model_dir), quantization="none", kv_cache_memory=0.05)
    assert floats.llm_engine.config.model_config.quantization is None
    assert _linear_methods(floats) == {UnquantizedLinearMethod}


# The LM head from the file's own blocks, untied (output.weight) or tied (token_embd.weight, whose
# float table the lookups keep): Q8_0 in int8 groups of 32, Q4_0 on the int4 kernel, Q5_0 in int8
# groups of 16. Its logits are transformers' (dequantizing) head's, so are the greedy tokens.
@pytest.mark.parametrize(
    ("head_quant", "tied", "method"),
    [("Q8_0", False, GroupedInt8Method), ("Q4_0", False, Int4KernelMethod), ("Q5_0", True, GroupedInt8Method)],
)
def test_a_block_quantized_head_is_the_files_weights_with_transformers_greedy_tokens(
    llama_model_dir: Path, tmp_path: Path, head_quant: str, tied: bool, method: type
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pagedllm.entrypoints.bench.gguf_export import write_gguf
    from pagedllm.hf_config import load_hf_config

    state: dict[str, Any] = {}
    for f in sorted(llama_model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    config = load_hf_config(llama_model_dir)
    if tied:
        state.pop("lm_head.weight", None)
        config = {**config, "tie_word_embeddings": True}
    path = write_gguf(state, config, tmp_path / "tiny.gguf", quant="Q4_1", head_quant=head_quant)
    prompts = [[5, 17, 99, 3, 250], [42, 7, 7, 300, 11, 64, 2], [1, 2, 3]]
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    llm = LLM(str(path), tokenizer=str(llama_model_dir), kv_cache_memory=0.05, max_model_len=128)
    model = _model(llm)
    head = model.lm_head
    # From the blocks, not requantized from the float head (GroupedInt8HeadMethod).
    assert isinstance(head.quant_method, method) and not isinstance(head.quant_method, GroupedInt8HeadMethod)
    assert head.weight.dtype in (torch.int8, torch.uint8)
    if tied:  # the lookups keep the float table
        assert model.model.embed_tokens.weight.dtype == torch.float32
    hidden = torch.randn(4, hf.config.hidden_size)
    torch.testing.assert_close(head(hidden), hidden @ hf.lm_head.weight.T, rtol=1e-5, atol=1e-5)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt) :].tolist()


def test_random_weights_of_a_gguf_shape_load_float(q4_1_gguf: Path, llama_model_dir: Path) -> None:
    llm = LLM(str(q4_1_gguf), tokenizer=str(llama_model_dir), load_format="dummy", kv_cache_memory=0.05)
    assert llm.llm_engine.config.model_config.quantization is None  # no file blocks to keep
    with pytest.raises(ValueError, match="quantization='gguf' .* load_format='dummy' reads no file"):
        LLM(str(q4_1_gguf), tokenizer=str(llama_model_dir), load_format="dummy", quantization="gguf")


def test_gguf_quantization_on_a_safetensors_model_is_a_value_error(llama_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="quantization='gguf' keeps a GGUF file's 4-bit linears .* not a .gguf file"):
        LLM(str(llama_model_dir), quantization="gguf")


def test_w4a8_on_a_gguf_file_keeps_its_blocks_with_int8_activations(
    q4_1_q8_head_gguf: Path, llama_model_dir: Path
) -> None:
    path = str(q4_1_q8_head_gguf)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = {"prompt_token_ids": [5, 17, 99, 3, 250, 42, 7, 7]}
    logprobs = {}
    for name in ("gguf", "w4a8"):
        llm = LLM(path, tokenizer=str(llama_model_dir), quantization=name, kv_cache_memory=0.05, max_model_len=64)
        methods = {m.quant_method for m in _model(llm).model.layers.modules() if hasattr(m, "quant_method")}
        assert all(isinstance(m, GGUFLinearMethod) and m.int8_activations == (name == "w4a8") for m in methods)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        logprobs[name] = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
        del llm
    diff = max(abs(a - b) for a, b in zip(logprobs["gguf"], logprobs["w4a8"]))
    assert 0 < diff < 0.2  # the file's weights, the activations rounded to int8
    dummy = LLM(path, tokenizer=str(llama_model_dir), load_format="dummy", quantization="w4a8", kv_cache_memory=0.05)
    methods = {type(m.quant_method) for m in _model(dummy).model.layers.modules() if hasattr(m, "quant_method")}
    assert methods == {W4A8LinearMethod}  # random float weights, quantized


def test_a_q8_0_gguf_keeps_int8_linears_with_transformers_greedy_tokens(
    llama_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pagedllm.entrypoints.bench.gguf_export import write_gguf
    from pagedllm.hf_config import load_hf_config

    state: dict[str, Any] = {}
    for f in sorted(llama_model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    path = write_gguf(
        state, load_hf_config(llama_model_dir), tmp_path_factory.mktemp("q8") / "tiny-Q8_0.gguf", quant="Q8_0"
    )
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    llm = LLM(str(path), tokenizer=str(llama_model_dir), kv_cache_memory=0.05, max_model_len=128)
    methods = {type(m.quant_method) for m in _model(llm).model.layers.modules() if hasattr(m, "quant_method")}
    assert methods == {GroupedInt8Method}
    prompts = [[5, 17, 99, 3, 250], [42, 7, 7, 300, 11, 64, 2]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt) :].tolist()
    stack = _model(llm).model._decode_stack  # the int8-group linears run in the decode stack ...
    assert stack is not None and set(stack.methods) == {5}
    logprobs = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    stacked = llm.generate([{"prompt_token_ids": p} for p in prompts], logprobs, use_tqdm=False)
    del llm
    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_STACK", "0")  # ... bitwise as the modules do
    modules = LLM(str(path), tokenizer=str(llama_model_dir), kv_cache_memory=0.05, max_model_len=128)
    for a, b in zip(stacked, modules.generate([{"prompt_token_ids": p} for p in prompts], logprobs, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs


def test_a_mixed_gguf_keeps_its_5_bit_linears_int8_with_transformers_greedy_tokens(
    llama_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like a Q4_K_M file: 4-bit linears with attn_v and ffn_down in more bits (Q5_1 and Q5_0 here,
    which gguf-py can write), so qkv mixes 4- and 5-bit parts."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pagedllm.entrypoints.bench.gguf_export import write_gguf
    from pagedllm.hf_config import load_hf_config

    state: dict[str, Any] = {}
    for f in sorted(llama_model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    path = write_gguf(
        state,
        load_hf_config(llama_model_dir),
        tmp_path_factory.mktemp("mixed") / "tiny-mixed.gguf",
        quant="Q4_1",
        overrides={"attn_v": "Q5_1", "ffn_down": "Q5_0"},
    )
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    llm = LLM(str(path), tokenizer=str(llama_model_dir), kv_cache_memory=0.05, max_model_len=128)
    layer = _model(llm).model.layers[0]
    qkv, down, gate_up = layer.self_attn.qkv_proj, layer.mlp.down_proj, layer.mlp.gate_up_proj
    assert isinstance(qkv.quant_method, GroupedInt8Method) and qkv.weight_zero is not None  # Q4_1 + Q5_1
    assert isinstance(down.quant_method, GroupedInt8Method) and down.weight_zero is None  # Q5_0: symmetric
    assert isinstance(gate_up.quant_method, GGUFLinearMethod) and gate_up.weight.dtype == torch.uint8
    prompts = [[5, 17, 99, 3, 250], [42, 7, 7, 300, 11, 64, 2]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt) :].tolist()
    llm.llm_engine.check_integrity()
    stack = _model(llm).model._decode_stack  # one C++ call with each linear's own method
    # qkv, o, gate_up, down: Q4_1's linears as int4 with offsets (the file's d and m)
    assert stack is not None and stack.methods[:4] == [5, 6, 6, 5]
    logprobs = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    stacked = llm.generate([{"prompt_token_ids": p} for p in prompts], logprobs, use_tqdm=False)
    del llm
    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_STACK", "0")  # the stack is bitwise the modules
    modules = LLM(str(path), tokenizer=str(llama_model_dir), kv_cache_memory=0.05, max_model_len=128)
    for a, b in zip(stacked, modules.generate([{"prompt_token_ids": p} for p in prompts], logprobs, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs
    modules.llm_engine.check_integrity()


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS"])
def test_an_iq4_gguf_stays_4bit_with_transformers_greedy_tokens(
    qtype: str, tiny_model_dir: Any, llama_model_dir: Path, tmp_path: Path
) -> None:
    """IQ4_NL / IQ4_XS linears (written by the exporter's own IQ4 quantizer: gguf-py has none) run
    on the int4 table op, in the C++ decode stack (method 8), with transformers' greedy tokens on
    its dequantizing GGUF load. IQ4_XS's blocks of 256 need a wider model than the tests' default."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pagedllm.entrypoints.bench.gguf_export import write_gguf
    from pagedllm.hf_config import load_hf_config

    src = llama_model_dir if qtype == "IQ4_NL" else tiny_model_dir("llama", hidden_size=256, intermediate_size=512)
    state: dict[str, Any] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    # IQ4_NL's LM head in IQ4_NL too (the table op from the file's blocks), IQ4_XS's float32.
    head_quant = qtype if qtype == "IQ4_NL" else None
    path = write_gguf(state, load_hf_config(src), tmp_path / f"tiny-{qtype}.gguf", quant=qtype, head_quant=head_quant)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    llm = LLM(str(path), tokenizer=str(src), kv_cache_memory=0.05, max_model_len=128)
    layers = _model(llm).model.layers
    for linear in (layers[0].self_attn.qkv_proj, layers[0].mlp.down_proj):
        assert isinstance(linear.quant_method, GGUFLinearMethod) and linear.quant_method.code_table
        assert linear.weight.dtype == torch.uint8
    head = _model(llm).lm_head
    if head_quant:
        assert head.quant_method.code_table and head.weight.dtype == torch.uint8
        hidden = torch.randn(4, hf.config.hidden_size)
        torch.testing.assert_close(head(hidden), hidden @ hf.lm_head.weight.T, rtol=1e-5, atol=1e-5)
    else:
        assert isinstance(head.quant_method, UnquantizedLinearMethod)
    prompts = [[5, 17, 99, 3, 250], [42, 7, 7, 300, 11, 64, 2]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert list(out.outputs[0].token_ids) == want[0, len(prompt) :].tolist()
    stack = _model(llm).model._decode_stack
    assert stack is not None and set(stack.methods) == {8}
    llm.llm_engine.check_integrity()
