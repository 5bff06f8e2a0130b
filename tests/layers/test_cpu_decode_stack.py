"""The one-call CPU decode stack (``layers/cpu_decode_stack.py``) against the modules it replaces:
the same kernels in the same order, so tokens and logprobs must be bitwise equal, on every model
family and weight method it takes; the ones it does not take keep running the modules."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.layers.cpu_decode_stack import STACK_PHASES, stack_phase_seconds
from pagedllm.layers.cpu_kernels import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels did not build here")


def _run(model_dir, monkeypatch, stack_on: bool, **engine_kw):
    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_STACK", "1" if stack_on else "0")
    llm = LLM(str(model_dir), max_model_len=256, device="cpu", seed=0, **engine_kw)
    # Prompts of 5-70 tokens: one longer than the Mistral model's 32-token window.
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 200 + 3 for j in range(n)]} for i, n in enumerate((5, 70, 19))]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7)
    outs = llm.generate(prompts, greedy, use_tqdm=False) + llm.generate(prompts, sampled, use_tqdm=False)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model.model
    return outs, model._decode_stack


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].logprobs == y.outputs[0].logprobs  # floats compared exactly


@pytest.mark.parametrize("arch", ["llama_model_dir", "qwen2_model_dir", "mistral_model_dir"])
def test_stack_equals_the_modules_bitwise(arch, request, monkeypatch):
    model_dir = request.getfixturevalue(arch)
    modules, none = _run(model_dir, monkeypatch, stack_on=False)
    stacked, stack = _run(model_dir, monkeypatch, stack_on=True)
    assert none is None and stack is not None, "the switch must choose the path"
    _same(stacked, modules)


def test_stack_serves_speculative_verification(llama_model_dir, monkeypatch):
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    modules, _ = _run(llama_model_dir, monkeypatch, stack_on=False, **spec)
    stacked, stack = _run(llama_model_dir, monkeypatch, stack_on=True, **spec)
    assert stack is not None
    _same(stacked, modules)


def test_qwen3_keeps_the_modules(qwen3_model_dir, monkeypatch):
    """Qwen3 normalises each q/k head before RoPE, which the op does not: no stack."""
    _, stack = _run(qwen3_model_dir, monkeypatch, stack_on=True)
    assert stack is None


@pytest.mark.parametrize("quantization", ["int8", "w8a8", "int4", "w4a8"])
def test_stack_takes_the_quantized_methods_bitwise(llama_model_dir, monkeypatch, quantization):
    modules, _ = _run(llama_model_dir, monkeypatch, stack_on=False, quantization=quantization)
    stacked, stack = _run(llama_model_dir, monkeypatch, stack_on=True, quantization=quantization)
    assert stack is not None and set(stack.methods) == {{"int8": 1, "w8a8": 2, "int4": 3, "w4a8": 4}[quantization]}
    _same(stacked, modules)


def test_stack_times_its_phases_when_asked(llama_model_dir, monkeypatch):
    """decode_stack_phases (benchmarks/decode_breakdown.py): while on, every phase of every stack
    step is timed and the steps counted; the tokens do not change; off, nothing is summed."""
    untimed, _ = _run(llama_model_dir, monkeypatch, stack_on=True)
    stack_phase_seconds(True)
    timed, stack = _run(llama_model_dir, monkeypatch, stack_on=True)
    phases, steps = stack_phase_seconds(False)
    assert stack is not None
    _same(timed, untimed)
    # Two generate calls of 12 tokens: at least 11 decode steps each ran the stack.
    assert steps >= 22
    assert set(phases) == set(STACK_PHASES)
    assert all(phases[name] > 0 for name in STACK_PHASES if name != "all_reduce"), phases
    assert phases["all_reduce"] >= 0  # one rank: only the clock reads between the phases
    _run(llama_model_dir, monkeypatch, stack_on=True)
    after, steps_after = stack_phase_seconds(False)
    assert steps_after == 0 and all(s == 0 for s in after.values())
