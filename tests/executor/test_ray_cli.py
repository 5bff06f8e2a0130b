"""End to end against a real ``ray start --head``: the OpenAI server's engine core joins the running
cluster (``RAY_ADDRESS``) and serves with two Ray actors as its ranks; when the server stops its
actors go, and when the head stops nothing of it is left."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from entrypoints.openai.conftest import RemoteServer, free_port

from pagedllm import LLM, SamplingParams

from .test_multiproc import _all_gone

pytest.importorskip("ray")

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


@pytest.fixture
def ray_head():
    """A head started as a user would (``--block`` keeps it in the foreground: SIGTERM stops this
    head alone, where ``ray stop`` would stop every Ray process on the machine)."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's socket paths live under it
    log = open(Path(temp) / "head.log", "w")
    cmd = ["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--include-dashboard=false"]
    cmd += ["--disable-usage-stats", f"--temp-dir={temp}", f"--object-store-memory={80 << 20}"]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **RAY_ENV}, start_new_session=True
    )
    try:
        _wait_for(lambda: "Ray runtime started" in (Path(temp) / "head.log").read_text(), 60, proc)
        yield proc, f"127.0.0.1:{port}"
    finally:
        tree = _tree(proc.pid)
        proc.terminate()
        try:
            proc.wait(20)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
            shutil.rmtree(temp, ignore_errors=True)
        assert _all_gone(tree, timeout=10), [p.pid for p in tree if p.is_running()]


def _wait_for(ready, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "ray start exited"
        assert time.monotonic() < deadline, "ray start did not come up"
        time.sleep(0.2)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _rank_actors(head_pid: int) -> list[psutil.Process]:
    return [p for p in _tree(head_pid) if "RankActor" in " ".join(p.cmdline())]


def test_server_over_a_ray_start_cluster(ray_head, llama_model_dir):
    head, address = ray_head
    prompt, greedy = "the quick brown fox", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(str(llama_model_dir), dtype="float32").generate([prompt], greedy, use_tqdm=False)
    args = ["--served-model-name", "tiny", "--dtype", "float32", "-tp", "2", "--distributed-executor-backend", "ray"]
    with RemoteServer(llama_model_dir, args, env={**RAY_ENV, "RAY_ADDRESS": address}) as srv:
        actors = _rank_actors(head.pid)
        assert len(actors) == 2  # the ranks run under the head's raylet, not under the server
        out = srv.openai_client().completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == ref[0].outputs[0].text
        assert "connected to the running cluster" in srv.log()
    assert _all_gone(actors, timeout=10)


_LOCAL = """
import logging, sys
from pagedllm import LLM, SamplingParams
logging.basicConfig(level=logging.INFO)
llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray", dtype="float32")
out = llm.generate([sys.argv[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
llm.llm_engine.shutdown()
print(*out[0].outputs[0].token_ids)
"""


def test_without_a_cluster_starts_a_local_one(llama_model_dir):
    """No cluster to join: the engine starts a private Ray instance and stops it at shutdown."""
    if any(p.info["name"] == "gcs_server" for p in psutil.process_iter(["name"])):
        pytest.skip("a Ray instance runs on this machine: address='auto' would join it")
    prompt = "the quick brown fox"
    ref = LLM(str(llama_model_dir), dtype="float32").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    temp = tempfile.mkdtemp(prefix="rl", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | RAY_ENV | {"RAY_TMPDIR": temp}
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOCAL, str(llama_model_dir), prompt],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
    assert proc.returncode == 0, err[-3000:]
    assert "no cluster running, started a local one" in err
    assert [int(t) for t in out.split()] == list(ref[0].outputs[0].token_ids)
