"""Bad adapters are a ValueError naming the adapter at intake, never a crash in a step."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.engine_checks import assert_idle_and_intact

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_model_dir) -> LLM:
    return LLM(str(llama_model_dir), dtype="float32", enable_lora=True, max_lora_rank=16, max_model_len=128)


def _refused(llm: LLM, lora: LoRARequest, *fragments: str) -> None:
    with pytest.raises(ValueError) as info:
        llm.generate([[1, 2, 3], [4, 5]], PARAMS, use_tqdm=False, lora_request=[None, lora])
    message = str(info.value)
    assert repr(lora.lora_name) in message, message
    for fragment in fragments:
        assert fragment in message, message
    assert_idle_and_intact(llm)


def test_missing_directory(llm, tmp_path):
    _refused(llm, LoRARequest("ghost", 1, str(tmp_path / "nope")), "not a directory")


def test_malformed_config(llm, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{not json")
    _refused(llm, LoRARequest("broken", 2, str(tmp_path)), "adapter_config.json")


def test_missing_weights(llm, tmp_path, llama_model_dir, make_adapter):
    adapter = make_adapter(llama_model_dir, seed=1)
    (tmp_path / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    _refused(llm, LoRARequest("noweights", 3, str(tmp_path)), "adapter_model.safetensors")


def test_rank_above_max_lora_rank(llm, llama_model_dir, make_adapter):
    adapter = make_adapter(llama_model_dir, seed=1, r=32, alpha=32)
    _refused(llm, LoRARequest("big", 4, str(adapter)), "rank 32", "--max-lora-rank")


def test_unknown_target_module(llm, llama_model_dir, make_adapter):
    adapter = make_adapter(llama_model_dir, seed=1, target_modules=["q_proj", "lm_head"])
    _refused(llm, LoRARequest("head", 5, str(adapter)), "lm_head", "q_proj")


def test_adapter_for_another_base(llm, tiny_model_dir, make_adapter):
    other = tiny_model_dir("llama", hidden_size=32, intermediate_size=64)
    adapter = make_adapter(other, seed=1)
    _refused(llm, LoRARequest("foreign", 6, str(adapter)), "shape", "another model")


def test_bias_other_than_none(llm, tmp_path, llama_model_dir, make_adapter):
    adapter = make_adapter(llama_model_dir, seed=1)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "bias": "all"}))
    _refused(llm, LoRARequest("biased", 7, str(tmp_path)), "bias")


def test_lora_request_without_enable_lora(llama_model_dir, make_adapter):
    llm = LLM(str(llama_model_dir), dtype="float32", max_model_len=128)
    adapter = make_adapter(llama_model_dir, seed=1)
    _refused(llm, LoRARequest("off", 1, str(adapter)), "--enable-lora")


def test_lora_config_checks():
    from pagedllm.config import EngineArgs

    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2).create_lora_config()
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineArgs(enable_lora=True, max_lora_rank=0).create_lora_config()
    assert EngineArgs(max_loras=3).create_lora_config() is None


def test_adapter_whose_weights_break_after_intake_fails_only_its_request(llm, tmp_path, llama_model_dir, make_adapter):
    """The worker reads the weights at the adapter's first step: a file truncated since intake's
    header check fails that request with an error naming the adapter; the batch's other rows are
    served, nothing of the failed rows' KV stays in the prefix cache, and the fixed file then
    serves the same prompt correctly."""
    import shutil

    from tests.lora.conftest import hf_greedy

    good = make_adapter(llama_model_dir, seed=7)
    shutil.copytree(good, tmp_path / "flaky")
    weights = tmp_path / "flaky" / "adapter_model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) - 64])  # the header still reads; the data is short
    flaky = LoRARequest("flaky", 8, str(tmp_path / "flaky"))
    prompt = [(7 * i + 3) % 500 for i in range(40)]  # two full blocks the prefix cache would index
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    served, failed = llm.generate([prompt, prompt], greedy, use_tqdm=False, lora_request=[None, flaky])
    assert served.outputs[0].finish_reason == "length"
    assert list(served.outputs[0].token_ids) == hf_greedy(llama_model_dir, None, prompt, 6)
    assert failed.outputs[0].finish_reason == "error"
    assert "'flaky' could not be loaded" in str(failed.outputs[0].stop_reason)
    assert list(failed.outputs[0].token_ids) == []
    assert_idle_and_intact(llm)
    weights.write_bytes(whole)
    (again,) = llm.generate([prompt], greedy, use_tqdm=False, lora_request=flaky)
    assert list(again.outputs[0].token_ids) == hf_greedy(llama_model_dir, good, prompt, 6)
    assert again.num_cached_tokens == 0, "a failed request's blocks must not answer prefix lookups"
    assert_idle_and_intact(llm)
