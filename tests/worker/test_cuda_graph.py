"""CUDA graphs for decode-only steps.

On CPU: the size buckets, eligibility, padding into the static buffers, and a whole generation
through the graph runner with ``EagerGraph`` (replay re-runs the forward into the captured output)
over the Triton backend in its interpreter, which must give the same tokens as running eagerly.
On CUDA: real graphs against ``enforce_eager``, token for token.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedllm.sampling.sampler import DraftBatch
from pagedllm.worker.batch_inputs import BatchInputs
from pagedllm.worker.cuda_graph import (
    CudaGraphRunner,
    EagerGraph,
    StaticInputs,
    capture_sizes,
    graphs_enabled,
    padded_size,
)
from pagedllm.worker.flat_batch import build_flat_batch

CUDA = torch.cuda.is_available()
BLOCK = 16


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    full = capture_sizes(256)
    assert full[:5] == [1, 2, 4, 8, 16] and full[-1] == 256 and len(full) == 35
    assert capture_sizes(1000) == full


def test_padded_size():
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert padded_size(65, sizes) is None


def test_graphs_enabled_only_for_triton_on_cuda():
    eager = SimpleNamespace(enforce_eager=True, lora_config=None)
    graphs = SimpleNamespace(enforce_eager=False, lora_config=None)
    lora = SimpleNamespace(enforce_eager=False, lora_config=object())
    triton, torch_backend = SimpleNamespace(name="triton"), SimpleNamespace(name="torch")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_enabled(graphs, cuda, triton)
    assert not graphs_enabled(eager, cuda, triton)
    assert not graphs_enabled(lora, cuda, triton)  # LoRA decodes eagerly
    assert not graphs_enabled(graphs, cuda, torch_backend)
    assert not graphs_enabled(graphs, cpu, triton)


def test_enforce_eager_flag(llama_model_dir):
    import argparse

    from pagedllm.config import EngineArgs
    from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from_namespace(parser.parse_args([])).enforce_eager is False
    assert engine_args_from_namespace(parser.parse_args(["--enforce-eager"])).enforce_eager is True
    config = EngineArgs(model=str(llama_model_dir), device="cpu", enforce_eager=True).create_engine_config()
    assert config.enforce_eager is True


def _batch(tokens, starts, tables, drafts=()) -> BatchInputs:
    ids, positions, attn = build_flat_batch(tokens, starts, tables, BLOCK, torch.device("cpu"))
    draft_batch = DraftBatch([len(drafts)], torch.tensor(drafts, dtype=torch.int64), None) if drafts else None
    return BatchInputs(
        req_ids=[str(i) for i in range(len(tokens))],
        input_ids=ids,
        positions=positions,
        attn=attn,
        starts=np.asarray(starts),
        num_scheduled=np.asarray([len(t) for t in tokens]),
        logits_indices=torch.zeros(0, dtype=torch.int64),
        drafts=draft_batch,
    )


def _runner(max_num_seqs: int, width: int = 4) -> CudaGraphRunner:
    return CudaGraphRunner(
        torch.nn.Identity(),
        SimpleNamespace(name="triton"),
        capture_sizes(max_num_seqs),
        width,
        BLOCK,
        64,
        torch.device("cpu"),
        make_graph=EagerGraph,
    )


def test_can_run_decode_only_batches_that_fit():
    runner = _runner(4)
    decode = _batch([[5], [6], [7]], [3, 17, 40], [[1], [2, 3], [4, 5, 6]])
    assert runner.can_run(decode)
    assert not runner.can_run(_batch([[5, 6], [7]], [0, 4], [[1], [2]]))  # a prefill chunk
    assert not runner.can_run(_batch([[5]] * 5, [1] * 5, [[1]] * 5))  # more than the largest graph
    with_drafts = _batch([[5, 8, 9]], [3], [[1]], drafts=[8, 9])
    assert not runner.can_run(with_drafts)


def test_static_inputs_padding():
    inputs = StaticInputs.allocate(8, width=4, device=torch.device("cpu"))
    assert inputs.slot_mapping.tolist() == [-1] * 8 and inputs.query_start_loc.tolist() == list(range(9))
    inputs.load(_batch([[5], [6], [7], [8], [9]], [3] * 5, [[1, 2, 3]] * 5), 8)  # a previous, larger step
    inputs.load(_batch([[11], [12], [13]], [3, 17, 40], [[1], [2, 3], [4, 5, 6]]), 4)
    assert inputs.input_ids[:3].tolist() == [11, 12, 13] and inputs.positions[:3].tolist() == [3, 17, 40]
    assert inputs.slot_mapping[:4].tolist() == [1 * 16 + 3, 3 * 16 + 1, 6 * 16 + 8, -1]  # row 3: padding, no write
    assert inputs.seq_lens[:4].tolist() == [4, 18, 41, 0]  # padding reads no keys
    assert inputs.block_table[:3, :3].tolist() == [[1, 0, 0], [2, 3, 0], [4, 5, 6]]
    md = inputs.metadata(4, BLOCK, 64)
    assert md.num_actual_tokens == 4 and md.num_reqs == 4 and md.max_query_len == 1
    assert md.block_table.shape == (4, 4) and md.slot_mapping.shape == (4,)
    assert md.block_table.data_ptr() == inputs.block_table.data_ptr()  # views: what the graph reads


def test_run_pads_replays_and_slices():
    """With a model that echoes its inputs, run() returns the real rows of the padded replay."""

    class Echo(torch.nn.Module):
        def forward(self, ids, positions, md):
            return torch.stack([ids, positions, md.slot_mapping, md.seq_lens], dim=1)

    runner = CudaGraphRunner(
        Echo(),
        SimpleNamespace(name="x", build_metadata=lambda c: c),
        [1, 2, 4],
        4,
        BLOCK,
        64,
        torch.device("cpu"),
        make_graph=EagerGraph,
    )
    runner.capture()
    assert sorted(runner.outputs) == [1, 2, 4] and runner.outputs[4].shape == (4, 4)
    with torch.inference_mode():  # as in execute_model
        out = runner.run(_batch([[11], [12], [13]], [3, 17, 40], [[1], [2, 3], [4, 5, 6]]))
    assert out.tolist() == [[11, 3, 19, 4], [12, 17, 49, 18], [13, 40, 104, 41]]
    assert runner.outputs[4][3, 2:].tolist() == [-1, 0]  # the padding row
    assert runner.num_replays == 1


def _interpreted_triton() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is not installed")
    from pagedllm.layers.attention.ops import triton_paged_attention

    if not triton_paged_attention.interpreting():
        pytest.skip("triton was imported without TRITON_INTERPRET=1: its kernels cannot run on CPU here")


@pytest.mark.skipif(CUDA, reason="CPU stand-in; on CUDA the real-graph test below runs")
def test_engine_decode_through_graph_runner_matches_eager(tiny_model_dir, monkeypatch):
    """Padding, static buffers and slicing, end to end over the Triton kernels (interpreted)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _interpreted_triton()
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir("llama")), attention_backend="triton", device="cpu", max_num_seqs=4, max_model_len=64)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 20, 9)]
    # Different lengths: the batch shrinks 3 -> 2 -> 1 (padded to 4, 2, 1) as requests finish.
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (7, 4, 2)]
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert runner.cuda_graphs is None  # nothing is captured off CUDA
    config = runner.config
    runner.cuda_graphs = CudaGraphRunner(
        runner.model,
        runner.attn_backend,
        capture_sizes(4),
        config.blocks_per_max_len_request(),
        runner.block_size,
        64,
        runner.device,
        make_graph=EagerGraph,
    )
    runner.cuda_graphs.capture()
    graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert graphed == eager
    # Six decode steps after the prefill: 3 requests (padded to 4), 2, 2, then 1, 1, 1.
    assert runner.cuda_graphs.num_replays == 6
    llm.llm_engine.check_integrity()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_graphs_match_eager_on_gpu(tiny_model_dir, dtype):
    from pagedllm import LLM, SamplingParams

    model = str(tiny_model_dir("llama"))
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 20, 9, 40, 1)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 12, 25, 5, 17)]
    outs, runners = {}, {}
    for eager in (True, False):
        llm = LLM(
            model,
            device="cuda",
            dtype=dtype,
            max_num_seqs=8,
            max_model_len=128,
            enforce_eager=eager,
            gpu_memory_utilization=0.3,
        )
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runners[eager] = llm.llm_engine.engine_core.executor.worker.model_runner
    assert runners[True].cuda_graphs is None
    assert runners[False].cuda_graphs is not None and runners[False].cuda_graphs.num_replays > 0
    assert outs[False] == outs[True]
