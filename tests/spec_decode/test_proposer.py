"""The proposer contract: explicit ProposerInputs (never the model runner), the factory, and the
draft model's KV registered like the target's."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.ngram import NgramSpecProposer
from pagedllm.spec_decode.proposer import Proposals, ProposerInputs, speculation_room
from pagedllm.worker.kv_layers import attention_layers
from pagedllm.worker.model_runner import ModelRunner

K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class CheckingProposer:
    """Checks what it is given (the arrays are views, valid during the call), then proposes each
    request's last emitted token, repeated (right or wrong)."""

    models: list = []

    def __init__(self) -> None:
        self.num_sampled: list[int] = []  # per call: how many requests had sampled

    def propose(self, inputs: ProposerInputs) -> Proposals:
        _check_inputs(inputs)
        self.num_sampled.append(len(inputs.sample_batch_rows))
        proposals = Proposals()
        for i, row in enumerate(inputs.sample_batch_rows.tolist()):
            room = int(inputs.max_proposals[i])
            if room:
                proposals.token_ids[inputs.req_ids[row]] = [inputs.emitted[i][-1]] * room
        return proposals


def _check_inputs(inputs: ProposerInputs) -> None:
    assert not any(isinstance(getattr(inputs, f.name), ModelRunner) for f in dataclasses.fields(inputs))
    assert inputs.hidden_states.shape[0] == int(inputs.num_scheduled.sum())
    assert len(inputs.emitted) == len(inputs.sample_batch_rows) == len(inputs.max_proposals)
    assert all(0 <= room <= K for room in inputs.max_proposals.tolist())
    for i, row in enumerate(inputs.sample_batch_rows.tolist()):
        tokens = inputs.token_ids[row, : inputs.num_tokens[row]].tolist()
        assert tokens[len(tokens) - len(inputs.emitted[i]) :] == inputs.emitted[i]  # the row ends with them
    if len(inputs.sample_batch_rows):
        assert inputs.sampling is not None and inputs.sampling.num_rows == len(inputs.req_ids)


def test_a_fake_proposer_gets_explicit_inputs_and_output_stays_exact(llama_model_dir):
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8] * 5, list(range(30, 60)), [9, 9, 9])]
    reference = LLM(str(llama_model_dir), max_model_len=128).generate(prompts, GREEDY, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": K}
    llm = LLM(str(llama_model_dir), max_model_len=128, speculative_config=spec, max_num_batched_tokens=16)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    runner.proposer = fake = CheckingProposer()
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    assert sum(o.metrics.spec_num_draft_tokens for o in outputs) > 0  # its proposals were verified
    assert 0 in fake.num_sampled and max(fake.num_sampled) == 3  # prefill-chunk steps are proposed on too


def _inputs(rows: list[list[int]], rooms: list[int]) -> ProposerInputs:
    width = max(len(r) for r in rows) + 4
    token_ids = np.full((len(rows), width), 77, dtype=np.int64)  # garbage past each row's end
    for i, r in enumerate(rows):
        token_ids[i, : len(r)] = r
    n = len(rows)
    return ProposerInputs(
        req_ids=[f"r{i}" for i in range(n)],
        token_ids=token_ids,
        num_tokens=np.array([len(r) for r in rows]),
        starts=np.array([len(r) - 1 for r in rows]),
        num_scheduled=np.ones(n, dtype=np.int64),
        block_table=np.ones((n, 1), dtype=np.int64),
        block_size=16,
        hidden_states=torch.zeros(n, 4),
        sample_batch_rows=np.arange(n),
        emitted=[[r[-1]] for r in rows],
        max_proposals=np.array(rooms),
        sampling=None,
    )


def test_ngram_proposer_reads_only_the_rows_and_respects_the_room():
    proposer = NgramSpecProposer(K, 1, 3)
    repeat = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    proposals = proposer.propose(_inputs([repeat, repeat, [5, 6, 7]], [3, 0, 2]))
    assert proposals.token_ids == {"r0": [3, 4, 1]}  # r1 has no room, r2's tail occurs nowhere earlier
    assert proposals.probs == {} and proposer.models == []
    assert proposer.propose(_inputs([repeat], [1])).token_ids == {"r0": [3]}


def test_speculation_room_limits():
    params = SamplingParams(temperature=0.0, max_tokens=10)
    assert speculation_room(params, num_tokens=20, num_output_tokens=0, k=4, max_model_len=100) == 4
    assert speculation_room(params, num_tokens=20, num_output_tokens=8, k=4, max_model_len=100) == 1  # max_tokens
    assert speculation_room(params, num_tokens=97, num_output_tokens=0, k=4, max_model_len=100) == 2  # length
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert speculation_room(penalized, num_tokens=20, num_output_tokens=0, k=4, max_model_len=100) == 0


def test_spec_decode_modules_do_not_import_the_runner():
    script = textwrap.dedent("""
        import sys
        import pagedllm.spec_decode.ngram  # the contract and the n-gram proposer: numpy only
        assert "torch" not in sys.modules, "the proposer contract imports torch"
        import pagedllm.spec_decode.factory
        assert "pagedllm.worker.model_runner" not in sys.modules, "a proposer module imports the runner"
        import pagedllm.spec_decode.proposer, pagedllm.spec_decode.ngram
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.fixture(scope="module")
def draft_runner(tiny_model_dir):
    target = tiny_model_dir("llama")
    draft = tiny_model_dir("llama", seed=7, num_layers=1)
    config = EngineArgs(
        model=str(target),
        device="cpu",
        max_model_len=64,
        speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": K},
    ).create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    return runner


def test_draft_model_kv_is_registered_like_the_targets(draft_runner):
    runner = draft_runner
    assert isinstance(runner.proposer, DraftModelProposer)
    assert runner.models == [runner.model, runner.proposer.model]
    target_layers, draft_layers = attention_layers([runner.model]), attention_layers([runner.proposer.model])
    assert target_layers and draft_layers
    num_blocks = runner.config.blocks_per_max_len_request() + 3
    runner.initialize_kv_cache(num_blocks)
    assert len(runner.kv_caches) == len(target_layers) + len(draft_layers)
    for layer, cache in zip(target_layers + draft_layers, runner.kv_caches):
        assert layer.kv_cache is cache and cache.shape[1] == num_blocks  # each layer its own tensor
    assert len({c.data_ptr() for c in runner.kv_caches}) == len(runner.kv_caches)
