"""Multi-LoRA offline: mixed-adapter batches against transformers + PEFT, token for token."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.engine_checks import assert_idle_and_intact
from tests.lora.conftest import hf_greedy

NEW_TOKENS = 12
PROMPTS = [[5, 17, 42, 99, 7], [300, 2, 2, 8, 64, 11, 90, 13, 250, 3], [1, 400], [77] * 20]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _llm(model_dir, **kw) -> LLM:
    kw.setdefault("max_loras", 4)
    return LLM(str(model_dir), dtype="float32", enable_lora=True, max_model_len=256, **kw)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_three_adapters_and_base_in_one_batch_match_peft(arch, tiny_model_dir, make_adapter):
    base = tiny_model_dir(arch)
    adapters = [
        make_adapter(base, seed=1),
        make_adapter(base, seed=2, r=4, alpha=8),
        make_adapter(base, seed=3, r=8, alpha=32, use_rslora=True),
    ]
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    # Every prompt with every adapter and the base model, all in one generate call (one batch).
    cases = [(p, lora) for p in PROMPTS for lora in [None, *loras]]
    llm = _llm(base)
    got = _tokens(llm.generate([p for p, _ in cases], GREEDY, use_tqdm=False, lora_request=[c[1] for c in cases]))
    paths = {None: None, **{lora: adapters[i] for i, lora in enumerate(loras)}}
    want = [hf_greedy(base, paths[lora], p, NEW_TOKENS) for p, lora in cases]
    assert got == want
    per_prompt = [got[i : i + 4] for i in range(0, len(got), 4)]
    assert all(len({tuple(t) for t in group}) > 1 for group in per_prompt), "adapters must change the output"
    assert_idle_and_intact(llm)


def test_subset_of_target_modules(llama_model_dir, make_adapter):
    attn_only = make_adapter(llama_model_dir, seed=4, target_modules=["q_proj", "v_proj"])
    mlp_only = make_adapter(llama_model_dir, seed=5, target_modules=["down_proj", "up_proj"])
    loras = [LoRARequest("attn", 1, str(attn_only)), LoRARequest("mlp", 2, str(mlp_only))]
    llm = _llm(llama_model_dir)
    got = _tokens(llm.generate([PROMPTS[0], PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=loras))
    assert got == [hf_greedy(llama_model_dir, a, p, NEW_TOKENS) for a, p in zip([attn_only, mlp_only], PROMPTS)]
    assert_idle_and_intact(llm)


def _manager(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner.lora


def test_one_slot_serves_three_adapters_by_eviction_and_reload(llama_model_dir, make_adapter):
    paths = [make_adapter(llama_model_dir, seed=s) for s in (1, 2, 3)]
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    llm = _llm(llama_model_dir, max_loras=1, max_cpu_loras=1)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    requests = [loras[0], loras[1], loras[2], loras[0]]
    want = [hf_greedy(llama_model_dir, paths[r.lora_int_id - 1], p, NEW_TOKENS) for p, r in zip(prompts, requests)]
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)) == want
    manager = _manager(llm)
    first_loads = manager.num_loads
    assert first_loads >= 3 and len(manager.host) == 1 and len(manager.slot_of) == 1
    # Again, in reverse: every adapter is evicted and read back, with the same tokens.
    got = _tokens(llm.generate(prompts[::-1], GREEDY, use_tqdm=False, lora_request=requests[::-1]))
    assert got == want[::-1]
    assert manager.num_loads > first_loads
    assert_idle_and_intact(llm)


def test_scheduler_runs_at_most_max_loras_adapters_per_step(llama_model_dir, make_adapter):
    paths = [make_adapter(llama_model_dir, seed=s) for s in (1, 2, 3)]
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    llm = _llm(llama_model_dir, max_loras=2)
    engine = llm.llm_engine
    for i, lora in enumerate([loras[0], loras[1], loras[2], None, loras[0]]):
        engine.add_request(str(i), PROMPTS[i % len(PROMPTS)], GREEDY, lora_request=lora)
    scheduler = engine.engine_core.scheduler
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        running = {r.lora_int_id for r in scheduler.running if r.lora_request is not None}
        assert len(running) <= 2
        seen |= running
    assert seen == {1, 2, 3}
    assert_idle_and_intact(llm)


def test_prefix_cache_is_shared_within_an_adapter_only(llama_model_dir, make_adapter):
    paths = [make_adapter(llama_model_dir, seed=s) for s in (1, 2)]
    a, b = (LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths))
    llm = _llm(llama_model_dir, enable_prefix_caching=True, block_size=16)
    prompt = list(range(10, 60))  # three full blocks

    def cached(lora) -> int:
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
        return out.num_cached_tokens

    assert cached(a) == 0
    assert cached(b) == 0  # another adapter: nothing shared
    assert cached(None) == 0  # the base model shares nothing with either
    assert cached(a) == 48 and cached(b) == 48 and cached(None) == 48  # the same adapter (or base) does
    assert_idle_and_intact(llm)


def test_decode_steps_with_adapters_run_the_cpu_decode_stack(llama_model_dir, make_adapter):
    """The one-call C++ decode stack adds the adapters' deltas itself: decode steps with adapter
    rows take it (on CPU float32 with the kernels built), with the PEFT tokens."""
    from pagedllm.layers import cpu_decode_stack

    path = make_adapter(llama_model_dir, seed=1)
    llm = _llm(llama_model_dir)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    calls = []
    original = cpu_decode_stack.DecodeStack.__call__

    def counting(self, hidden, positions, metadata):
        calls.append(self.lora_a != [])
        return original(self, hidden, positions, metadata)

    cpu_decode_stack.DecodeStack.__call__ = counting  # type: ignore[method-assign]
    try:
        got = _tokens(llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(path))))
    finally:
        cpu_decode_stack.DecodeStack.__call__ = original  # type: ignore[method-assign]
    if model.model.decode_stack() is None:
        pytest.skip("the CPU decode stack does not apply here (no kernels)")
    assert calls and all(calls), "decode steps must run the stack, with the LoRA tensors"
    assert got == [hf_greedy(llama_model_dir, path, PROMPTS[0], NEW_TOKENS)]
    assert_idle_and_intact(llm)


def test_adapters_under_speculative_decoding(llama_model_dir, make_adapter):
    """n-gram proposals are verified by the adapter's model: the tokens stay PEFT's."""
    paths = [make_adapter(llama_model_dir, seed=s) for s in (1, 2)]
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    llm = _llm(llama_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = [PROMPTS[3], PROMPTS[3], PROMPTS[3]]  # repetitive: the n-gram proposer has matches
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[loras[0], None, loras[1]]))
    assert got == [hf_greedy(llama_model_dir, p, PROMPTS[3], NEW_TOKENS) for p in (paths[0], None, paths[1])]
    assert_idle_and_intact(llm)


def test_bfloat16_slots_match_peft_on_bfloat16_representable_adapters(llama_model_dir, make_adapter, tmp_path):
    """--lora-dtype bfloat16 on a float32 model: the slots hold bfloat16 and the kernels widen them,
    so adapters whose weights bfloat16 represents exactly (and a power-of-two scale) give PEFT's
    float32 tokens, in a mixed batch with base rows."""
    import shutil

    from safetensors.torch import load_file, save_file

    paths = []
    for seed in (1, 2):
        rounded = tmp_path / f"bf16-{seed}"
        shutil.copytree(make_adapter(llama_model_dir, seed=seed), rounded)
        weights = rounded / "adapter_model.safetensors"
        tensors = {k: v.to(torch.bfloat16).float() for k, v in load_file(weights).items()}
        save_file(tensors, weights)
        paths.append(rounded)
    loras = [LoRARequest(f"b{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    llm = _llm(llama_model_dir, lora_dtype="bfloat16")
    manager = _manager(llm)
    assert manager.dtype == torch.bfloat16
    assert all(s.a.dtype == torch.bfloat16 and s.kernel is not None for s in manager.layers.values())
    cases = [(p, lora) for p in PROMPTS[:3] for lora in [None, *loras]]
    got = _tokens(llm.generate([p for p, _ in cases], GREEDY, use_tqdm=False, lora_request=[c[1] for c in cases]))
    by_lora = {None: None, loras[0]: paths[0], loras[1]: paths[1]}
    assert got == [hf_greedy(llama_model_dir, by_lora[lora], p, NEW_TOKENS) for p, lora in cases]
    assert_idle_and_intact(llm)


def test_unknown_lora_dtype_is_refused(llama_model_dir):
    with pytest.raises(ValueError, match="lora_dtype must be one of auto, float32, bfloat16, float16"):
        _llm(llama_model_dir, lora_dtype="int8")
