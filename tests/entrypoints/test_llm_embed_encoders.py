"""Embedding models as users get them: BERT-family encoders with sentence-transformers files
(checked against sentence-transformers itself) and bare decoders (``Qwen3Model``) that default to
the pooling runner; encoders run each prompt whole, in one step, and keep no KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog, and then some more words follow it",
    "a",
    "embedding models map text to vectors",
]


@pytest.mark.parametrize(
    ("arch", "pooling", "normalize"),
    [("bert", "mean", True), ("bert", "cls", False), ("roberta", "mean", True), ("xlm-roberta", "cls", True)],
)
def test_encoder_embeddings_equal_sentence_transformers(tiny_encoder_dir, arch, pooling, normalize):
    from sentence_transformers import SentenceTransformer

    model_dir = tiny_encoder_dir(arch, pooling=pooling, normalize=normalize)
    expected = SentenceTransformer(str(model_dir), device="cpu").encode(TEXTS, convert_to_numpy=True)
    llm = LLM(str(model_dir))
    assert llm.llm_engine.config.model_config.runner == "pooling"  # the default for an encoder
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    np.testing.assert_allclose(got, expected, atol=2e-5)
    llm.llm_engine.check_integrity()


def test_encoder_runs_whole_prompts_in_one_step_and_keeps_no_kv(bert_model_dir):
    llm = LLM(str(bert_model_dir), max_num_batched_tokens=16)  # raised to max_model_len for an encoder
    config = llm.llm_engine.config
    assert config.scheduler_config.max_num_batched_tokens == config.model_config.max_model_len == 128
    assert not config.scheduler_config.chunked_prefill and not config.cache_config.enable_prefix_caching
    assert config.kv_bytes_per_block() == 0
    assert llm.llm_engine.engine_core.executor.worker.model_runner.kv_caches == []  # no KV tensors at all
    steps = []
    scheduler = llm.llm_engine.engine_core.scheduler
    schedule = scheduler.schedule

    def recording_schedule():
        output = schedule()
        steps.append(dict(output.num_scheduled_tokens))
        return output

    scheduler.schedule = recording_schedule
    prompts = [{"prompt_token_ids": [2] + [10 + i] * n + [3]} for i, n in enumerate((126, 60, 60, 5))]
    outputs = llm.embed(prompts, use_tqdm=False)
    assert [len(o.prompt_token_ids) for o in outputs] == [128, 62, 62, 7]
    for step in steps:  # each request's whole prompt in one step, never a chunk
        for req_id, count in step.items():
            assert count == len(outputs[int(req_id)].prompt_token_ids)
    # 128 fills a step; 62 + 62 share the next (the 7 would overflow the 128-token budget: it waits)
    assert [sorted(s.values(), reverse=True) for s in steps if s] == [[128], [62, 62], [7]]
    llm.llm_engine.check_integrity()


def test_encoder_input_longer_than_the_model_is_an_error(bert_model_dir):
    llm = LLM(str(bert_model_dir))
    with pytest.raises(ValueError, match=r"max_model_len\) is 128"):
        llm.embed({"prompt_token_ids": [5] * 129}, use_tqdm=False)
    [out] = llm.embed({"prompt_token_ids": [5] * 129}, use_tqdm=False, truncate_prompt_tokens=128)
    assert len(out.prompt_token_ids) == 128
    with pytest.raises(ValueError, match="cannot generate text"):
        llm.generate("hello", use_tqdm=False)
    llm.llm_engine.check_integrity()


def test_encoder_refuses_the_generate_runner(bert_model_dir):
    with pytest.raises(ValueError, match="no language-model head"):
        LLM(str(bert_model_dir), runner="generate")


def test_bare_decoder_defaults_to_last_token_pooling(bare_qwen3_model_dir):
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bare_qwen3_model_dir)
    hf = AutoModel.from_pretrained(bare_qwen3_model_dir, dtype=torch.float32)
    llm = LLM(str(bare_qwen3_model_dir), num_gpu_blocks_override=64)
    for text, out in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False)):
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = F.normalize(hf(ids).last_hidden_state[0, -1], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=2e-5, rtol=1e-4)
    llm.llm_engine.check_integrity()
