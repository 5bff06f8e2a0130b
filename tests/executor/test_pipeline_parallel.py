"""Pipeline parallelism: each stage (one worker process) builds, loads and caches only its layers,
and two stages give the same greedy tokens as one process in float32, through chunked prefill,
prefix caching and preemption; a bad layer split is a clear error; a killed stage fails the engine
cleanly and leaves nothing running."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import safetensors
import torch
from entrypoints.openai.conftest import RemoteServer

from executor.test_multiproc import ENGINE, GREEDY, PROMPTS, _all_gone, _min_top2_gap, _run, _workers
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.distributed.partition import layer_partition
from pagedllm.distributed.pipeline import PPGroup, set_pp_group
from pagedllm.executor.multiproc import WorkerDiedError
from pagedllm.hf_config import load_arch_config
from pagedllm.models.loader import load_model


@pytest.fixture(scope="module")
def three_layer_dir(tiny_model_dir):
    """Three layers (an uneven split) and a tied LM head (the last stage keeps the table)."""
    return tiny_model_dir("llama", num_layers=3, tie_word_embeddings=True)


def _pagedllm_shm() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith("pagedllm")}


def _num_blocks(llm: LLM) -> int:
    return llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool.num_blocks


@pytest.mark.parametrize("layers, pp, sizes", [(4, 2, [2, 2]), (3, 2, [2, 1]), (10, 4, [2, 3, 3, 2]), (30, 1, [30])])
def test_even_split_gives_leftovers_to_the_stages_before_the_last(layers, pp, sizes, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_PP_LAYER_PARTITION", raising=False)
    assert layer_partition(layers, pp) == sizes
    ranges = [PPGroup(stage, pp).layer_range(layers) for stage in range(pp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in stage order


def test_pp2_even_split_matches_one_process(llama_model_dir):
    model_dir = str(llama_model_dir)
    ref_llm = LLM(model_dir, **ENGINE)
    reference = _run(ref_llm)
    assert _min_top2_gap(ref_llm) > 1e-4
    llm = LLM(model_dir, pipeline_parallel_size=2, **ENGINE)
    workers = _workers(llm)
    assert len(workers) == 2 and all(w.ppid() == os.getpid() for w in workers)
    try:
        assert _run(llm) == reference  # chunked prefill and prefix-cache hits
        # Sampling: only the last stage draws, the first embeds what it drew next step.
        seeded = SamplingParams(temperature=1.0, max_tokens=8, seed=7)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], seeded, use_tqdm=False)] == [
            o.outputs[0].token_ids for o in ref_llm.generate(PROMPTS[:2], seeded, use_tqdm=False)
        ]
        llm.llm_engine.check_integrity()
    finally:
        llm.llm_engine.shutdown()
    assert _all_gone(workers)


def test_pp2_preemption_matches_one_process(llama_model_dir):
    """Too few blocks for every request at once: some are preempted and recomputed."""
    prompts = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 2 for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # 23 usable 8-token blocks (one request of max_model_len needs 16); each request wants ~9.
    tight = dict(ENGINE, max_model_len=128, num_gpu_blocks_override=24)
    reference = [
        o.outputs[0].token_ids for o in LLM(str(llama_model_dir), **tight).generate(prompts, params, use_tqdm=False)
    ]
    llm = LLM(str(llama_model_dir), pipeline_parallel_size=2, **tight)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.llm_engine.engine_core.scheduler.total_preemptions > 0
        assert got == reference
        llm.llm_engine.check_integrity()
    finally:
        llm.llm_engine.shutdown()


def test_uneven_split_matches_and_sizes_kv_by_the_fullest_stage(three_layer_dir, monkeypatch):
    model_dir = str(three_layer_dir)
    per_layer = EngineArgs(model=model_dir, **ENGINE).create_engine_config().kv_bytes_per_block(1)
    # 100 blocks of the 2-layer stage (200 of the 1-layer one, 66 of all three layers).
    memory = dict(ENGINE, kv_cache_memory=(200.5 * per_layer) / (1 << 30))
    ref_llm = LLM(model_dir, **memory)
    reference = _run(ref_llm, rounds=1)
    assert _min_top2_gap(ref_llm) > 1e-4 and _num_blocks(ref_llm) == 66
    for partition in ("2,1",):
        monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", partition)  # the spawned stages inherit it
        llm = LLM(model_dir, pipeline_parallel_size=2, **memory)
        try:
            assert _num_blocks(llm) == 100  # the fewest any stage fits
            assert _run(llm, rounds=1) == reference
        finally:
            llm.llm_engine.shutdown()


def test_tp2_times_pp2_matches_one_process(llama_model_dir):
    """Four processes: two stages of two tensor-parallel ranks each."""
    model_dir = str(llama_model_dir)
    reference = _run(LLM(model_dir, **ENGINE), rounds=1)
    llm = LLM(model_dir, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE)
    workers = _workers(llm)
    assert len(workers) == 4
    try:
        assert _run(llm, rounds=1) == reference
    finally:
        llm.llm_engine.shutdown()
    assert _all_gone(workers)


def test_a_stage_builds_and_reads_only_its_layers(three_layer_dir, monkeypatch):
    """Stage 1 of "1,2": layers 1-2, the final norm and the (tied) LM head; stage 0 tensors are
    never read from the checkpoint."""
    read: list[str] = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", "1,2")
    arch = load_arch_config(three_layer_dir)
    set_pp_group(PPGroup(rank=1, size=2))
    try:
        model = load_model(str(three_layer_dir), arch, dtype=torch.float32, device="cpu")
    finally:
        set_pp_group(None)
    params = {name.split(".weight")[0] for name, _ in model.named_parameters()}
    assert not any(n.startswith("model.layers.0.") for n in params)
    assert any(n.startswith("model.layers.1.") for n in params) and any(n.startswith("model.layers.2.") for n in params)
    assert "model.norm" in params and "model.embed_tokens" in params  # the tied head's table
    assert read and not any(n.startswith("model.layers.0.") for n in read)


@pytest.mark.parametrize(
    "partition, message",
    [
        ("1,1,1", "has 3 entries; pipeline_parallel_size=2 needs 2"),
        ("3,0", "every stage needs at least one layer"),
        ("1,1", "sums to 2; the model has 3 layers"),
        ("a,b", "comma-separated layer counts"),
    ],
)
def test_bad_partition_is_a_clear_error(three_layer_dir, monkeypatch, partition, message):
    monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", partition)
    with pytest.raises(ValueError, match=message):
        LLM(str(three_layer_dir), pipeline_parallel_size=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pipeline_parallel_size": 4}, "exceeds the model's 3 layers"),
        ({"pipeline_parallel_size": 2, "tensor_parallel_size": 3}, r"tensor_parallel_size=3 cannot split"),
        ({"pipeline_parallel_size": 2, "enable_lora": True}, "--enable-lora is not supported with pipeline"),
    ],
)
def test_unsupported_pipeline_settings_are_clear_errors(three_layer_dir, kwargs, message):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=message):
        LLM(str(three_layer_dir), **kwargs)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before | _tracker_pids()


def _tracker_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children() if "resource_tracker" in " ".join(p.cmdline())}


def test_killed_stage_fails_the_engine_cleanly(llama_model_dir):
    shm_before = _pagedllm_shm()
    llm = LLM(str(llama_model_dir), pipeline_parallel_size=2, **ENGINE)
    workers = _workers(llm)
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    engine.step()  # requests in flight
    engine.step()
    os.kill(workers[0].pid, signal.SIGKILL)  # the first stage: the last one waits on it
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 0") as info:
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 5
    assert "signal 9" in str(info.value)
    assert _all_gone(workers)  # the surviving stage is stopped too
    engine.shutdown()  # idempotent
    assert _pagedllm_shm() <= shm_before


def test_server_pp2_completion_matches_one_process(llama_model_dir):
    """Four prompts in one request: the engine core keeps two batches of them in flight."""
    prompts = ["the quick brown fox", "hello world", "one two three", "a b c d e f g"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(str(llama_model_dir), dtype="float32").generate(prompts, params, use_tqdm=False)
    with RemoteServer(llama_model_dir, ["--served-model-name", "tiny", "--dtype", "float32", "-pp", "2"]) as srv:
        tree = psutil.Process(srv.proc.pid).children(recursive=True)
        assert len(tree) >= 3  # the engine core and its two stages
        out = srv.openai_client().completions.create(
            model="tiny", prompt=prompts, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        got = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
        assert got == [r.outputs[0].text for r in ref]
    assert _all_gone(tree, timeout=10)
