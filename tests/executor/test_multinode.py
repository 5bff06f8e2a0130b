"""Two "nodes" on one machine without Ray: node 0 at 127.0.0.2 (the engine, rank 0), node 1 at
127.0.0.3 (``pagedllm serve --headless``, rank 1), TP=2 across them. Linux routes all of 127/8 to
lo, so no setup is needed; the control connection is bound to each node's own address, so a node
that used another address would be seen (and node 0 listens only on its own)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from entrypoints.openai.conftest import RemoteServer, free_port

from pagedllm import LLM, SamplingParams
from pagedllm.config.parallel import ParallelArgs, ParallelConfig
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.net import is_loopback, node_ip

from .netns import two_namespaces
from .test_multiproc import ENGINE, GREEDY, PROMPTS, _all_gone, _min_top2_gap, _run, _shm_segments

HEAD, NODE1 = "127.0.0.2", "127.0.0.3"
_INIT = dict(distributed_init_method="tcp://10.0.0.1:29500")
CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]


TP2 = ("-tp", "2")


def _node_flags(port: int, rank: int, sizes: tuple[str, ...] = TP2) -> list[str]:
    return [*sizes, "--nnodes", "2", "--node-rank", str(rank), "--distributed-init-method", f"tcp://{HEAD}:{port}"]


class HeadlessNode:
    """``pagedllm serve MODEL ... --node-rank 1 --headless`` in its own process group."""

    def __init__(self, model: Path, port: int, log: Path, sizes: tuple[str, ...] = TP2) -> None:
        self.log_path = log
        self._log = open(log, "w")
        cmd = [*CLI, "serve", str(model), *_node_flags(port, 1, sizes), "--headless"]
        env = {**os.environ, "PAGEDLLM_HOST_IP": NODE1}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


@pytest.fixture
def node1(llama_model_dir, tmp_path):
    """Started before node 0: it retries until node 0 listens."""
    port = free_port()
    node = HeadlessNode(llama_model_dir, port, tmp_path / "node1.log")
    yield port, node
    node.close()


@pytest.mark.parametrize(
    "sizes, kwargs",
    [
        (TP2, dict(tensor_parallel_size=2)),
        # The last stage, whose answer is the step's output, runs on node 1.
        (("-pp", "2"), dict(pipeline_parallel_size=2)),
    ],
    ids=["tp2", "pp2"],
)
def test_two_nodes_match_one_process(llama_model_dir, tmp_path, sizes, kwargs):
    port, model = free_port(), str(llama_model_dir)
    node = HeadlessNode(llama_model_dir, port, tmp_path / "node1.log", sizes)  # first: it retries until node 0 listens
    try:
        ref_llm = LLM(model, **ENGINE)
        reference = _run(ref_llm, rounds=1)
        assert _min_top2_gap(ref_llm) > 1e-4
        before = _shm_segments()
        llm = LLM(model, nnodes=2, node_rank=0, distributed_init_method=f"tcp://{HEAD}:{port}", **kwargs, **ENGINE)
        tree = node.tree()
        try:
            executor = llm.llm_engine.engine_core.executor
            assert isinstance(executor, MultiprocExecutor)
            assert len(executor.procs) == 1  # rank 0 here, rank 1 on node 1
            assert executor.remote[1].ip == NODE1 and executor.remote[1].node_rank == 1
            assert executor.remote[1].pid in {p.pid for p in tree}
            assert _run(llm, rounds=1) == reference
            assert _shm_segments() == before  # across hosts the all-reduce is gloo's
        finally:
            llm.llm_engine.shutdown()
        assert node.proc.wait(15) == 0, node.log()  # node 0 shut down cleanly: so does node 1
        assert _all_gone(tree, timeout=5)
    finally:
        node.close()


def _server(model: Path, port: int) -> RemoteServer:
    return RemoteServer(model, ["--served-model-name", "tiny", "--dtype", "float32", *_node_flags(port, 0)])


def _complete(srv: RemoteServer) -> str:
    out = srv.openai_client().completions.create(
        model="tiny", prompt="the quick brown fox", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def test_killed_node_stops_the_server(llama_model_dir, node1):
    port, node = node1
    ref = LLM(str(llama_model_dir), dtype="float32").generate(
        ["the quick brown fox"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    with _server(llama_model_dir, port) as srv:
        tree = [psutil.Process(srv.proc.pid), *psutil.Process(srv.proc.pid).children(recursive=True)]
        assert _complete(srv) == ref[0].outputs[0].text
        node_tree = node.tree()
        os.killpg(node.proc.pid, signal.SIGKILL)  # node 1 goes away while node 0 is idle
        start = time.monotonic()
        assert srv.proc.wait(20) == 1, srv.log()
        took = time.monotonic() - start
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{srv.url}/health", timeout=1)
        log = srv.log()
        assert "worker rank 1 on node 1 (127.0.0.3" in log
    assert took < 15, log
    assert _all_gone(tree + node_tree, timeout=5)


def test_killed_head_stops_the_node(llama_model_dir, node1):
    port, node = node1
    with _server(llama_model_dir, port) as srv:
        node_tree = node.tree()
        assert len(node_tree) >= 2  # the headless process and its rank
        os.killpg(srv.proc.pid, signal.SIGKILL)
        assert node.proc.wait(20) == 1, node.log()
    assert _all_gone(node_tree, timeout=5)
    assert "closed the connection without a shutdown" in node.log()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(nnodes=2, node_rank=2), r"node_rank=2 is out of range for nnodes=2: use 0..1"),
        (dict(tensor_parallel_size=3, nnodes=2), r"= 3 ranks cannot be split evenly over nnodes=2"),
        (dict(headless=True), r"--headless are for runs over several nodes: give --nnodes N > 1"),
        (dict(tensor_parallel_size=2, nnodes=2), r"needs --distributed-init-method tcp://<node 0's IP>:<port>"),
        (dict(distributed_init_method="tcp://10.0.0.1:29500"), r"give --nnodes N > 1"),
        (
            dict(tensor_parallel_size=2, nnodes=2, node_rank=1, **_INIT),
            r"start it with `pagedllm serve MODEL \.\.\. --headless`",
        ),
        (
            dict(tensor_parallel_size=2, nnodes=2, headless=True, **_INIT),
            r"node 0 runs the engine and the server: drop --headless",
        ),
        (
            dict(tensor_parallel_size=2, nnodes=2, distributed_init_method="10.0.0.1:29500"),
            r"must be tcp://HOST:PORT",
        ),
        (
            dict(tensor_parallel_size=2, nnodes=2, distributed_init_method="tcp://10.0.0.1"),
            r"must be tcp://HOST:PORT",
        ),
        (
            dict(tensor_parallel_size=2, nnodes=2, distributed_executor_backend="ray", **_INIT),
            r"the Ray backend places them on its cluster's nodes itself",
        ),
    ],
)
def test_bad_node_flags_say_what_to_change(kwargs, message, monkeypatch):
    monkeypatch.setattr("pagedllm.config.parallel.check_ray_installed", lambda: None)
    with pytest.raises(ValueError, match=message):
        ParallelArgs(**kwargs).create_parallel_config()


def test_headless_cli_errors_exit_2(llama_model_dir):
    bad = subprocess.run(
        [*CLI, "serve", str(llama_model_dir), "--headless"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "give --nnodes N > 1" in bad.stderr and "Traceback" not in bad.stderr
    flags = ["-tp", "2", "--nnodes", "2", "--node-rank", "1", "--distributed-init-method", "tcp://127.0.0.2:1"]
    env = {**os.environ, "PAGEDLLM_HOST_IP": "10.254.254.254"}  # not an address of this machine
    done = subprocess.run([*CLI, "serve", *flags, "--headless"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and "10.254.254.254 (PAGEDLLM_HOST_IP) is not an address of node 1" in done.stderr


def test_offline_engine_is_never_headless(llama_model_dir):
    with pytest.raises(ValueError, match="headless runs only a node's worker ranks"):
        LLM(
            str(llama_model_dir),
            tensor_parallel_size=2,
            nnodes=2,
            node_rank=1,
            headless=True,
            distributed_init_method="tcp://127.0.0.2:29500",
        )


def test_a_node_with_other_sizes_is_refused(llama_model_dir, tmp_path):
    """Node 1 started with -pp 2 besides -tp 2 (4 ranks, 2 a node): node 0 refuses it, naming both."""
    port = free_port()
    node = HeadlessNode(llama_model_dir, port, tmp_path / "node1.log", sizes=("-tp", "2", "-pp", "2"))
    try:
        with pytest.raises(ValueError, match=r"pipeline_parallel_size=2.*but node 0 runs.*pipeline_parallel_size=1"):
            LLM(str(llama_model_dir), tensor_parallel_size=2, nnodes=2, distributed_init_method=f"tcp://{HEAD}:{port}")
        assert node.proc.wait(30) == 2, node.log()
        assert "node 0 refused rank" in node.log()
    finally:
        node.close()


_DRIVER = """
import json, sys
from pagedllm import LLM, SamplingParams
prompts, engine, greedy = json.loads(sys.argv[3]), json.loads(sys.argv[4]), json.loads(sys.argv[5])
llm = LLM(sys.argv[1], tensor_parallel_size=2, nnodes=2, distributed_init_method=sys.argv[2], **engine)
remote = llm.llm_engine.engine_core.executor.remote[1].ip
outputs = llm.generate(prompts, SamplingParams(**greedy), use_tqdm=False)
llm.llm_engine.check_integrity()
llm.llm_engine.shutdown()
print(json.dumps({"remote": remote, "tokens": [list(o.outputs[0].token_ids) for o in outputs]}))
"""


def test_two_network_hosts_match_one_process(llama_model_dir, tmp_path):
    """Real hosts (network namespaces, each with its own loopback): node 1 finds its address from
    the route to node 0, and gloo must advertise it, not 127.0.0.1, or the ranks cannot connect."""
    greedy = dict(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True)
    with two_namespaces() as (a, b, net):
        reference = LLM(str(llama_model_dir), **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
        init = f"tcp://{net}.1:29500"
        flags = ["-tp", "2", "--nnodes", "2", "--node-rank", "1", "--distributed-init-method", init, "--headless"]
        log = open(tmp_path / "node1.log", "w")
        node = subprocess.Popen(
            ["ip", "netns", "exec", b, *CLI, "serve", str(llama_model_dir), *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            args = [str(llama_model_dir), init, json.dumps(PROMPTS), json.dumps(ENGINE), json.dumps(greedy)]
            cmd = ["ip", "netns", "exec", a, sys.executable, "-c", _DRIVER, *args]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            assert done.returncode == 0, done.stderr[-3000:]
            assert node.wait(30) == 0
        finally:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait(10)
            log.close()
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["remote"] == f"{net}.2"  # its routable address, found from the route to node 0
    assert got["tokens"] == [list(o.outputs[0].token_ids) for o in reference]


def _config(node_rank: int, host: str) -> ParallelConfig:
    return ParallelArgs(
        tensor_parallel_size=2,
        nnodes=2,
        node_rank=node_rank,
        headless=node_rank > 0,
        distributed_init_method=f"tcp://{host}:29500",
    ).create_parallel_config()


def test_node_addresses(monkeypatch):
    """Node 0 is the init method's host; another node its route to it, or PAGEDLLM_HOST_IP; a
    loopback address only when node 0's is loopback too."""
    monkeypatch.delenv("PAGEDLLM_HOST_IP", raising=False)
    assert node_ip(_config(0, HEAD)) == HEAD
    assert is_loopback(node_ip(_config(1, HEAD)))  # every node on this machine: loopback is right
    with pytest.raises(ValueError, match=r"10\.254\.254\.254 \(the --distributed-init-method host\) is not an address"):
        node_ip(_config(0, "10.254.254.254"))
    monkeypatch.setenv("PAGEDLLM_HOST_IP", NODE1)
    assert node_ip(_config(1, HEAD)) == NODE1
    with pytest.raises(ValueError, match=r"loopback address 127\.0\.0\.3, which node 0 \(10\.254\.254\.254\)"):
        node_ip(_config(1, "10.254.254.254"))
    with pytest.raises(ValueError, match=r"PAGEDLLM_HOST_IP=127\.0\.0\.3 on node 0 differs"):
        node_ip(_config(0, HEAD))
