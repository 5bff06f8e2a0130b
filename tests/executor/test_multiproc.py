"""Tensor parallelism through the real engine: the multiprocess executor (one worker process per
rank, gloo) gives the same greedy tokens as one rank in float32, and no worker outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from entrypoints.openai.conftest import RemoteServer

from pagedllm import LLM, SamplingParams, cpu_info
from pagedllm.distributed import shm_allreduce
from pagedllm.executor.multiproc import MultiprocExecutor, WorkerDiedError
from pagedllm.layers.cpu_kernels import cpu_ops

# A shared prefix (prefix caching), a prompt longer than the step budget (chunked prefill), and
# several requests in flight at once.
_PREFIX = "the quick brown fox jumps over the lazy dog " * 3
PROMPTS = [
    _PREFIX + "and then",
    _PREFIX + "while the cat",
    "hello world",
    "one two three four five six seven eight nine ten " * 8,
    "a b c d e f g",
]
# Small blocks and a small step budget: prefixes span whole blocks, the long prompt is chunked.
BLOCK, BUDGET = 8, 64
ENGINE = dict(dtype="float32", block_size=BLOCK, max_num_batched_tokens=BUDGET, max_num_seqs=8, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)


def _run(llm: LLM, rounds: int = 2) -> list[list[int]]:
    """Every prompt, ``rounds`` times (later rounds hit the prefix cache)."""
    tokens = []
    for _ in range(rounds):
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outputs]
    # The last round read cached prefixes (every prompt of a full block or more).
    assert rounds == 1 or all(o.num_cached_tokens > 0 for o in outputs if len(o.prompt_token_ids or []) > BLOCK)
    assert max(len(o.prompt_token_ids or []) for o in outputs) > BUDGET  # chunked
    llm.llm_engine.check_integrity()
    return tokens


def _min_top2_gap(llm: LLM) -> float:
    """The reference's smallest gap between the top two logprobs (exact match needs no near-ties)."""
    gap = float("inf")
    for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False):
        for position in out.outputs[0].logprobs or []:
            top = sorted((lp.logprob for lp in position.values()), reverse=True)
            gap = min(gap, top[0] - top[1])
    return gap


def _workers(llm: LLM) -> list[psutil.Process]:
    executor = llm.llm_engine.engine_core.executor
    assert isinstance(executor, MultiprocExecutor)
    return [psutil.Process(p.pid) for p in executor.procs]


def _all_gone(procs: list[psutil.Process], timeout: float = 5.0) -> bool:
    """Every process exited (zombies count as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def mqa_model_dir(tiny_model_dir):
    """One KV head: at TP=2 each rank holds a replica of it."""
    return tiny_model_dir("llama", num_kv_heads=1)


@pytest.mark.parametrize("fixture", ["llama_model_dir", "qwen2_model_dir", "mqa_model_dir"])
def test_tp2_greedy_matches_tp1(fixture, request):
    model_dir = str(request.getfixturevalue(fixture))
    ref_llm = LLM(model_dir, **ENGINE)
    reference = _run(ref_llm)
    assert _min_top2_gap(ref_llm) > 1e-4
    llm = LLM(model_dir, tensor_parallel_size=2, **ENGINE)
    workers = _workers(llm)
    assert len(workers) == 2 and all(w.ppid() == os.getpid() for w in workers)
    assert all(w.num_threads() < 16 for w in workers)  # one intra-op thread each, not the box's
    try:
        assert _run(llm) == reference
        # Unseeded and seeded sampling: every rank draws the same tokens, or the ranks' inputs
        # would diverge and the next all-reduce would fail or hang.
        sampled = SamplingParams(temperature=1.0, max_tokens=8)
        seeded = SamplingParams(temperature=1.0, max_tokens=8, seed=7)
        llm.generate(PROMPTS, [sampled, seeded] * 2 + [sampled], use_tqdm=False)
        llm.llm_engine.check_integrity()
    finally:
        llm.llm_engine.shutdown()
    assert _all_gone(workers)


@pytest.mark.parametrize("fixture", ["llama_model_dir", "bert_model_dir"])
def test_tp2_embeddings_match_tp1(fixture, request):
    """The pooling runner at TP=2: a decoder's last-token and an encoder's mean embeddings."""
    model_dir = str(request.getfixturevalue(fixture))
    kwargs = dict(runner="pooling", dtype="float32", num_gpu_blocks_override=64)
    texts = PROMPTS[:3]  # within the tiny encoder's 128 positions
    reference = [o.outputs.embedding for o in LLM(model_dir, **kwargs).embed(texts, use_tqdm=False)]
    llm = LLM(model_dir, tensor_parallel_size=2, **kwargs)
    workers = _workers(llm)
    try:
        got = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
        for a, b in zip(got, reference):
            assert a == pytest.approx(b, abs=1e-5)
        llm.llm_engine.check_integrity()
    finally:
        llm.llm_engine.shutdown()
    assert _all_gone(workers)


def test_tp2_over_gloo_matches_tp1(llama_model_dir, monkeypatch):
    """The all-reduce through gloo (the shared-memory one turned off, as on non-x86 machines)."""
    model_dir = str(llama_model_dir)
    reference = _run(LLM(model_dir, **ENGINE), rounds=1)
    monkeypatch.setenv("PAGEDLLM_SHM_ALLREDUCE", "0")  # the spawned workers inherit it
    llm = LLM(model_dir, tensor_parallel_size=2, **ENGINE)
    try:
        assert _run(llm, rounds=1) == reference
    finally:
        llm.llm_engine.shutdown()


def _greedy_with_logprobs(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.llm_engine.check_integrity()
    return [
        (list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in p.items()} for p in o.outputs[0].logprobs or []])
        for o in outputs
    ]


@pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels did not build here")
def test_tp2_decode_stack_matches_tp1_and_the_modules(llama_model_dir, monkeypatch, capfd):
    """At TP=2 each rank runs its decode steps as the one C++ call, all-reducing between the layers
    in C++ (x86: shared memory): the tokens are one rank's, and tokens and logprobs are bitwise
    those of the ranks running the modules (``PAGEDLLM_CPU_DECODE_STACK=0``)."""
    model_dir = str(llama_model_dir)
    reference = [tokens for tokens, _ in _greedy_with_logprobs(LLM(model_dir, **ENGINE))]
    runs = {}
    for stack in ("1", "0"):
        monkeypatch.setenv("PAGEDLLM_CPU_DECODE_STACK", stack)  # the spawned workers inherit it
        llm = LLM(model_dir, tensor_parallel_size=2, **ENGINE)
        try:
            runs[stack] = _greedy_with_logprobs(llm)
        finally:
            llm.llm_engine.shutdown()
        if stack == "1":
            log = capfd.readouterr().err
            # The shared-memory all-reduce joins ranks that each have a core (executor/multiproc.py).
            expected_path = shm_allreduce.supported() and cpu_info.usable_cpus() >= 2
            for rank in range(2):
                line = f"as one C++ call per decode step (tensor-parallel rank {rank} of 2, shared-memory"
                assert (line in log) == expected_path, log[-3000:]
    assert [tokens for tokens, _ in runs["1"]] == reference
    assert runs["1"] == runs["0"]  # logprobs compared exactly


def _shm_segments() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith("pagedllm-tp-")}


def test_tp_not_dividing_heads_lists_valid_sizes(llama_model_dir):
    with pytest.raises(ValueError, match=r"valid sizes: \[1, 2, 4\]"):
        LLM(str(llama_model_dir), tensor_parallel_size=3)


def test_worker_value_error_reaches_the_caller(llama_model_dir):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=r"num_gpu_blocks_override=2 cannot hold .*worker rank [01]"):
        LLM(str(llama_model_dir), tensor_parallel_size=2, num_gpu_blocks_override=2)
    spawned = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    # multiprocessing's resource tracker lives as long as this process, whatever started it
    assert _all_gone([p for p in spawned if "resource_tracker" not in " ".join(p.cmdline())])


def test_killed_worker_raises_naming_the_rank(llama_model_dir):
    llm = LLM(str(llama_model_dir), tensor_parallel_size=2, **ENGINE)
    workers = _workers(llm)
    llm.generate(["warm up"], SamplingParams(max_tokens=2), use_tqdm=False)
    os.kill(workers[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1") as info:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 5
    assert "signal 9" in str(info.value)
    assert _all_gone(workers)  # the surviving rank is stopped too
    llm.llm_engine.shutdown()  # idempotent
    assert not _shm_segments()  # unlinked once every rank attached


def test_a_rank_that_dies_between_steps_is_noticed(llama_model_dir):
    """The engine core's idle loop asks ``check_health()``: a dead rank raises without a request."""
    llm = LLM(str(llama_model_dir), tensor_parallel_size=2, **ENGINE)
    executor = llm.llm_engine.engine_core.executor
    workers = _workers(llm)
    executor.check_health()  # every rank alive: nothing to say
    os.kill(workers[1].pid, signal.SIGKILL)
    executor.procs[1].join(5)
    with pytest.raises(WorkerDiedError, match=r"rank 1 .*during 'an idle wait' \(killed by signal 9\)"):
        executor.check_health()
    assert _all_gone(workers)  # the other rank is stopped too
    llm.llm_engine.shutdown()


def test_server_tp2_completion_matches_tp1(llama_model_dir):
    prompt = "the quick brown fox"
    ref = LLM(str(llama_model_dir), dtype="float32").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    with RemoteServer(llama_model_dir, ["--served-model-name", "tiny", "--dtype", "float32", "-tp", "2"]) as srv:
        tree = psutil.Process(srv.proc.pid).children(recursive=True)
        assert len(tree) >= 3  # the engine core and its two ranks
        out = srv.openai_client().completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == ref[0].outputs[0].text
    assert _all_gone(tree, timeout=10)


_PARENT = """
import sys
from pagedllm import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2)
print(*(p.pid for p in llm.llm_engine.engine_core.executor.procs), flush=True)
sys.stdin.read()
"""


def test_workers_die_with_a_killed_parent(llama_model_dir):
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(llama_model_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        workers = [psutil.Process(int(pid)) for pid in proc.stdout.readline().split()]
        assert len(workers) == 2
        proc.kill()
        proc.wait(5)
        assert _all_gone(workers, timeout=2)
        assert not _shm_segments()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
