"""LLM.embed / LLM.encode on decoder models run with the pooling runner, against transformers'
hidden states pooled by hand (LAST, MEAN, CLS; normalized or not; Matryoshka dimensions)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM
from pagedllm.pooling_params import PoolingParams

PROMPTS = [
    "the quick brown fox jumps over the lazy dog " * 4,  # longer than the step budget: chunked
    "short one",
    "another prompt, a bit longer than that",
]


@pytest.fixture(scope="module")
def hf_states(llama_model_dir):
    """Per prompt: (token ids, transformers' last_hidden_state [n, hidden])."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_model_dir)
    model = AutoModel.from_pretrained(llama_model_dir, dtype=torch.float32)
    states = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            states.append((ids[0].tolist(), model(ids).last_hidden_state[0]))
    return states


def _pool(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), runner="pooling", max_num_batched_tokens=24, num_gpu_blocks_override=64, **kwargs)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embed_matches_transformers(llama_model_dir, hf_states, pooling_type):
    llm = _llm(llama_model_dir, pooler_config={"pooling_type": pooling_type})
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    for output, (ids, hidden) in zip(outputs, hf_states):
        assert output.prompt_token_ids == ids
        expected = F.normalize(_pool(hidden, pooling_type), dim=-1)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=2e-5, rtol=1e-4)
    llm.llm_engine.check_integrity()


def test_dimensions_truncate_then_normalize_and_normalize_off(llama_model_dir, hf_states):
    llm = _llm(llama_model_dir, pooler_config='{"pooling_type": "mean", "normalize": false}')
    raw = llm.encode(PROMPTS, use_tqdm=False)
    short = llm.encode(PROMPTS, PoolingParams(dimensions=8, normalize=True), use_tqdm=False)
    for r, s, (_, hidden) in zip(raw, short, hf_states):
        assert r.outputs is not None and s.outputs is not None
        torch.testing.assert_close(r.outputs.data, hidden.mean(0), atol=2e-5, rtol=1e-4)  # the model's default: off
        assert s.outputs.data.shape == (8,)
        torch.testing.assert_close(s.outputs.data, F.normalize(hidden.mean(0)[:8], dim=-1), atol=2e-5, rtol=1e-4)
    llm.llm_engine.check_integrity()


def test_embedding_requests_batch_and_share_nothing_after(llama_model_dir, hf_states):
    """Many prompts at once (several per step); LAST pooling may hit the prefix cache, the
    result is the same; every block is back in the pool afterwards."""
    llm = _llm(llama_model_dir)
    prompts = PROMPTS * 4
    outputs = llm.embed(prompts, use_tqdm=False)
    for i, output in enumerate(outputs):
        expected = F.normalize(hf_states[i % len(PROMPTS)][1][-1], dim=-1)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=2e-5, rtol=1e-4)
    scheduler = llm.llm_engine.engine_core.scheduler
    assert not scheduler.running and len(scheduler.waiting) == 0
    llm.llm_engine.check_integrity()


def test_truncate_prompt_tokens_keeps_the_last_tokens(llama_model_dir, hf_states):
    llm = _llm(llama_model_dir)
    ids, _ = hf_states[0]
    [whole] = llm.embed({"prompt_token_ids": ids[-5:]}, use_tqdm=False)
    [cut] = llm.embed(PROMPTS[0], use_tqdm=False, truncate_prompt_tokens=5)
    assert cut.prompt_token_ids == ids[-5:]
    assert cut.outputs.embedding == pytest.approx(whole.outputs.embedding, abs=1e-6)


def test_bad_input_is_a_value_error_and_leaks_nothing(llama_model_dir):
    llm = _llm(llama_model_dir, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed(["fine", "word " * 100], use_tqdm=False)
    with pytest.raises(ValueError, match="embedding size of 64"):
        llm.embed("x", PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.embed([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="cannot generate text"):
        llm.generate("hello", use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.check_integrity()


def test_generation_engine_refuses_embed(llama_model_dir):
    llm = LLM(str(llama_model_dir), num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="--runner pooling"):
        llm.embed("hello", use_tqdm=False)
    llm.llm_engine.check_integrity()
