"""``--kv-cache-dtype``: a float32 model keeping bfloat16 / float16 K/V on CPU.

The cache holds each K/V value rounded once (as torch's ``.to()`` rounds); attention widens it
back and computes in float32. So the output is the float32-cache engine's up to that rounding:
on the tiny model the greedy tokens are the same and the logprobs close. The prompts cover
chunked prefill on top of cached context and prefix-cache hits (the prefill path reads the 16-bit
context back), and decoding both through the one-call decode stack and through the modules.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.cpu_kernels import cpu_ops
from tests.engine_checks import assert_idle_and_intact

NEW_TOKENS = 12
SHARED = [(11 * j) % 190 + 5 for j in range(40)]
PROMPTS = [[(7 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((5, 70, 19))] + [
    SHARED + [7, 8, 9],
    SHARED + [21, 22],
]
# float16 keeps 11 significant bits, bfloat16 8: the logprobs move by about that share of their size.
LOGPROB_TOLERANCE = {"float16": 5e-3, "bfloat16": 5e-2}


def _generate(model_dir, **engine_kw):
    llm = LLM(str(model_dir), max_model_len=256, device="cpu", seed=0, max_num_batched_tokens=32, **engine_kw)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_idle_and_intact(llm)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    return outs, runner


def _assert_close(outs, reference, tolerance: float) -> None:
    for ours, ref in zip(outs, reference, strict=True):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
            for token, lp in b.items():
                if token in a:
                    assert abs(a[token].logprob - lp.logprob) < tolerance


@pytest.fixture(scope="module")
def float32_cache(llama_model_dir):
    return _generate(llama_model_dir)[0]


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("decode_stack", ["1", "0"])
def test_16_bit_cache_under_a_float32_model(llama_model_dir, float32_cache, monkeypatch, kv_cache_dtype, decode_stack):
    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_STACK", decode_stack)
    outs, runner = _generate(llama_model_dir, kv_cache_dtype=kv_cache_dtype)
    assert {c.dtype for c in runner.kv_caches} == {getattr(torch, kv_cache_dtype)}
    assert runner.dtype == torch.float32
    if cpu_ops() is not None:
        assert (runner.model.model._decode_stack is not None) == (decode_stack == "1")
    _assert_close(outs, float32_cache, LOGPROB_TOLERANCE[kv_cache_dtype])


def test_the_stack_and_the_modules_agree_bitwise_on_a_16_bit_cache(llama_model_dir, monkeypatch):
    if cpu_ops() is None:
        pytest.skip("the CPU kernels did not build here")
    runs = []
    for stack in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_CPU_DECODE_STACK", stack)
        runs.append(_generate(llama_model_dir, kv_cache_dtype="bfloat16")[0])
    for a, b in zip(*runs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # floats compared exactly


def test_the_torch_reference_path_matches_the_kernels(llama_model_dir, monkeypatch):
    """PAGEDLLM_CPU_KERNELS=0: the K/V write and attention in plain torch on the 16-bit cache."""
    kernels, _ = _generate(llama_model_dir, kv_cache_dtype="float16")
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    reference, runner = _generate(llama_model_dir, kv_cache_dtype="float16")
    assert runner.kv_caches[0].dtype == torch.float16
    _assert_close(kernels, reference, 1e-3)  # float32 sums in another order, then rounded to 16 bits


def test_a_16_bit_cache_holds_twice_the_blocks(llama_model_dir):
    """The same kv_cache_memory: each block takes half the bytes (8 KiB in float32 here)."""
    gib = 65 * 8192 / (1 << 30)
    counts = {}
    for kv in ("auto", "bfloat16"):
        llm = LLM(str(llama_model_dir), device="cpu", max_model_len=512, kv_cache_memory=gib, kv_cache_dtype=kv)
        counts[kv] = llm.llm_engine.engine_core.num_blocks
        assert_idle_and_intact(llm)
    assert counts == {"auto": 65, "bfloat16": 130}
