"""The llama.cpp baseline's quantized GGUFs (``--llama-cpp-type q8_0 / q4_0``): what the file holds
round-trips to the model's weights within each format's rounding, the bench tables name both
systems' weights, and (with llama-cpp-python) llama.cpp computes the function of the dequantized
weights."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedllm import cpu_info
from pagedllm.entrypoints.bench import baselines, llama_cpp
from pagedllm.entrypoints.bench.common import BenchModel, read_hf_config
from pagedllm.entrypoints.bench.gguf_export import gguf_tensors
from pagedllm.entrypoints.cli import main

gguf = pytest.importorskip("gguf")
# The largest rounding error per weight, as a share of its block's largest |weight|: Q8_0 rounds
# to amax/127 steps (half a step, plus the f16 scale's own rounding); Q4_0's scale is
# -(signed max)/8, so the other side of the block can clip by up to one step of amax/8.
BOUND = {"Q8_0": 0.51 / 127 + 1e-3, "Q4_0": 1 / 8 + 1e-3}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Any) -> BenchModel:
    return BenchModel(tiny_model_dir("llama"), "auto", False, "tiny llama")


def _flags(kind: str, head: str = "auto") -> argparse.Namespace:
    return argparse.Namespace(llama_cpp_type=kind, llama_cpp_head=head)


def _dequantized(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (GGML type name, float32 weights) as llama.cpp reads them."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        shape = tuple(reversed([int(n) for n in t.shape]))
        out[t.name] = (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape))
    return out


@pytest.mark.parametrize(
    ("kind", "head", "want_matrix", "want_head"),
    [("q8_0", "auto", "Q8_0", "Q8_0"), ("q4_0", "auto", "Q4_0", "Q8_0"), ("q4_0", "f32", "Q4_0", "F32")],
)
def test_quantized_gguf_round_trips(model: BenchModel, kind: str, head: str, want_matrix: str, want_head: str) -> None:
    state = baselines.load_hf_model(model.path, False, 0).state_dict()
    want = dict(gguf_tensors(state, read_hf_config(model.path)))
    with llama_cpp.gguf_for(model, 0, _flags(kind, head)) as path:
        got = _dequantized(path)
    assert set(got) == set(want)
    head = "output.weight" if "output.weight" in got else "token_embd.weight"  # untied / tied
    for name, (qtype, weights) in got.items():
        expected = want[name]
        if expected.ndim == 1:
            assert qtype == "F32" and np.array_equal(weights, expected), name
            continue
        assert qtype == (want_head if name == head else want_matrix), name
        if qtype == "F32":
            assert np.array_equal(weights, expected), name
            continue
        blocks = expected.reshape(-1, 32)
        err = np.abs(weights.reshape(-1, 32) - blocks).max(axis=1)
        amax = np.abs(blocks).max(axis=1)
        assert (err <= BOUND[qtype] * amax + 1e-7).all(), name
        assert err.max() > 0, f"{name}: a {qtype} tensor equal to float32 was not quantized"


def test_weights_labels_follow_the_flags() -> None:
    assert llama_cpp.weights_label(_flags("f32")) == "F32, head F32"
    assert llama_cpp.weights_label(_flags("q4_0")) == "Q4_0, head Q8_0"  # what llama-quantize writes here
    assert llama_cpp.weights_label(_flags("q8_0", "q4_0")) == "Q8_0, head Q4_0"


INFO_AVX2 = b"CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 0 | LLAMAFILE = 1 | "
INFO_AMX = b"CPU : AVX = 1 | AVX2 = 1 | FMA = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | OPENMP = 1 | "


@pytest.mark.parametrize(
    "info,cpu_amx,label,extra",
    [
        (INFO_AVX2, True, "AVX AVX2 F16C FMA", True),  # an AVX2 build on an AMX CPU keeps its repacking
        (INFO_AMX, True, "AVX AVX2 FMA AVX512 AVX512_VNNI AMX_INT8", False),  # its AMX path would run
        (INFO_AMX, False, "AVX AVX2 FMA AVX512 AVX512_VNNI AMX_INT8", True),
        (b"CPU : NEON = 1 | ARM_FMA = 1 | DOTPROD = 1 | SVE = 0 | ", False, "NEON DOTPROD", True),
    ],
)
def test_build_label_and_extra_buffer_types(
    monkeypatch: Any, info: bytes, cpu_amx: bool, label: str, extra: bool
) -> None:
    # The note names the features llama.cpp was built for; extra buffer types go off only where
    # its AMX path would run (built with AMX_INT8, on a CPU with AMX).
    fake = types.ModuleType("llama_cpp")
    fake.llama_print_system_info = lambda: info  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(cpu_info, "cpu_features", lambda: {"avx2", "amx_tile", "amx_int8"} if cpu_amx else {"avx2"})
    assert llama_cpp.build_label() == label
    assert llama_cpp.extra_buffer_types() is extra


def test_the_pagedllm_label_names_the_lm_head_as_built() -> None:
    import argparse
    import types

    from pagedllm.entrypoints.bench.latency import pagedllm_weights
    from pagedllm.layers.quantization.int8_groups import GroupedInt8HeadMethod
    from pagedllm.layers.quantization.unquantized import UnquantizedLinearMethod
    from pagedllm.layers.quantization.w8a8 import W8A8LinearMethod

    def label(quantization: str | None, head: Any) -> str:
        model = types.SimpleNamespace(lm_head=types.SimpleNamespace(quant_method=head))
        return pagedllm_weights(argparse.Namespace(dtype="float32", quantization=quantization), model)

    assert label("int4", GroupedInt8HeadMethod()) == "int4, head int8 g32"
    assert label("w8a8", W8A8LinearMethod()) == "w8a8, head w8a8"
    assert label("int8", UnquantizedLinearMethod()) == "int8, head float32"  # a head the kernel could not take
    assert label(None, None) == "float32"


def test_latency_table_names_each_systems_weights(capsys: Any, tmp_path: Path, model: BenchModel) -> None:
    from .test_bench import latency_args

    out_json = tmp_path / "report.json"
    argv = [*latency_args(model.path, "2", prefill_len="16"), "--quantization", "int8", "--llama-cpp-baseline"]
    assert main(["bench", *argv, "--llama-cpp-type", "q8_0", "--output-json", str(out_json)]) == 0
    stdout = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    weights = {(r["system"], r["weights"]) for r in report["results"]}
    assert ("pagedllm", "int8, head int8 g32") in weights
    header = next(line for line in stdout.splitlines() if "x floor" in line)
    assert header.split()[:2] == ["system", "weights"]
    if llama_cpp.available():
        assert ("llama.cpp", "Q8_0, head Q8_0") in weights
        assert any("Q8_0, head Q8_0 GGUF" in n for n in report["notes"])
    else:
        assert {s for s, _ in weights} == {"pagedllm"}
        assert any("skipped" in n for n in report["notes"])


@pytest.mark.parametrize(("kind", "tolerance"), [("f32", 1e-2), ("q8_0", 3e-2), ("q4_0", 3e-2)])
def test_llama_cpp_computes_the_dequantized_model(model: BenchModel, kind: str, tolerance: float) -> None:
    """llama.cpp on the quantized file against HF on the weights that file stands for: what is
    left is llama.cpp's 8-bit activations in its quantized matmuls and its f16 K/V."""
    pytest.importorskip("llama_cpp")
    from pagedllm.gguf_config import gguf_arch_config
    from pagedllm.models.gguf_loader import iterate_gguf

    hf = baselines.load_hf_model(model.path, False, 0)
    prompt = list(range(20, 60))
    with llama_cpp.gguf_for(model, 0, _flags(kind)) as path:
        loaded = hf.load_state_dict(dict(iterate_gguf(path, gguf_arch_config(path))), strict=False)
        assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}  # tied
        llm = llama_cpp.LlamaCpp(path, 1, 64, 64)
        try:
            llm.decode(llama_cpp.prompt_entries(prompt, 0))
            got = llm.last_logits(hf.config.vocab_size)
        finally:
            llm.close()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1].numpy()
    assert abs(got - expected).max() < tolerance * abs(expected).max()
