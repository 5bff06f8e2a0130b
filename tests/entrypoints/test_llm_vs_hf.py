"""The offline engine against Hugging Face transformers (the oracle), token for token.

Tiny random-weight models in float32: 8+ prompts of different lengths in one generate call,
greedy, 32 new tokens, ignore_eos. Token ids must be identical and top-5 logprobs within 1e-3,
also when prompts are chunked, when the KV pool is so small that requests are preempted and
recomputed, and when prompts share a long prefix that the prefix cache serves.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
NEW_TOKENS = 32
TOPK = 5
TEXTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Once upon a time, in a land far, far away, there lived a curious little robot",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "A long sentence " * 12,
    '{"name": "pagedllm", "blocks": [1, 2, 3], "ok": true}',
    "Emoji and accents: café, naïve, 東京, 🚀🚀",
    "The quick brown fox jumps over the lazy dog. " * 4,
]
SHARED_PREFIX = "You are a helpful assistant. Answer briefly and precisely. " * 3


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tiny_model_dir):
    """(model dir, prompts as token ids, HF reference) for one architecture."""
    kwargs = {"sliding_window": 24} if request.param == "mistral" else {}
    model_dir = tiny_model_dir(request.param, **kwargs)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(t) for t in TEXTS] + [tokenizer.encode(SHARED_PREFIX + t) for t in TEXTS[:3]]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, prompts, [_hf_greedy(hf, p) for p in prompts]


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with HF's forward and KV cache. (Not ``generate(min_new_tokens=...)``:
    that suppresses EOS, while the engine runs with ignore_eos and may emit it.)"""
    tokens, logprobs = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(NEW_TOKENS):
            step = torch.log_softmax(out.logits[0, -1].float(), -1)
            tokens.append(int(step.argmax()))
            logprobs.append(step)
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


def _run(model_dir, prompts, **engine_kwargs):
    llm = LLM(str(model_dir), **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOPK)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    return llm, outputs


def _assert_matches_hf(outputs, reference) -> None:
    for i, (out, (ref_tokens, ref_logprobs)) in enumerate(zip(outputs, reference)):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt {i}: tokens differ from HF"
        assert completion.finish_reason == "length"
        for step, (ours, ref) in enumerate(zip(completion.logprobs, ref_logprobs)):
            values, ids = ref.topk(TOPK + 1)
            top = {tok: lp for tok, lp in ours.items() if lp.rank is not None and lp.rank <= TOPK}
            assert len(top) == TOPK
            for tok, value in zip(ids[:TOPK].tolist(), values[:TOPK].tolist()):
                if tok not in top:  # only a near-tie at the top-k boundary may swap ids
                    assert abs(value - values[TOPK].item()) < 1e-3, f"prompt {i} step {step}"
                    continue
                assert abs(top[tok].logprob - value) < 1e-3, f"prompt {i} step {step} token {tok}"


def test_greedy_matches_hf(arch_case):
    model_dir, prompts, reference = arch_case
    _, outputs = _run(model_dir, prompts)
    _assert_matches_hf(outputs, reference)


def test_chunked_prefill_matches_hf(arch_case):
    model_dir, prompts, reference = arch_case
    llm, outputs = _run(model_dir, prompts, max_num_batched_tokens=16, max_num_seqs=4)
    _assert_matches_hf(outputs, reference)


def test_preemption_matches_hf(arch_case):
    model_dir, prompts, reference = arch_case
    # 18 blocks of 16 tokens (one is null) hold about one of these requests at full length.
    llm, outputs = _run(model_dir, prompts, max_model_len=256, num_gpu_blocks_override=18)
    assert llm.llm_engine.engine_core.scheduler.total_preemptions > 0
    _assert_matches_hf(outputs, reference)


def test_prefix_caching_matches_hf(arch_case):
    model_dir, prompts, reference = arch_case
    llm = LLM(str(model_dir), max_num_seqs=1)  # one at a time: later prompts find the shared prefix cached
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOPK)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    _assert_matches_hf(outputs, reference)
    shared = outputs[-3:]
    assert shared[0].num_cached_tokens == 0
    prefix_blocks = len(llm.get_tokenizer().encode(SHARED_PREFIX)) // 16
    assert prefix_blocks >= 2
    for out in shared[1:]:
        assert out.num_cached_tokens >= prefix_blocks * 16
