"""Two real network hosts on one machine: Linux network namespaces joined by a veth pair, a Ray
head in one and a Ray node in the other, the engine in the first. Each namespace has its own
loopback, so a rank that advertised 127.0.0.1 (what the hostname resolves to) could not be
reached: only this catches that. Needs root and iproute2; skipped otherwise."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pagedllm import LLM

from .test_multiproc import ENGINE, GREEDY, PROMPTS
from .test_ray_cli import RAY_ENV, _wait_for

pytest.importorskip("ray")

_DRIVER = """
import json, sys
from pagedllm import LLM, SamplingParams
prompts, engine, greedy = json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray", **engine)
places = [p.node_ip for p in llm.llm_engine.engine_core.executor.places]
outputs = llm.generate(prompts, SamplingParams(**greedy), use_tqdm=False)
llm.llm_engine.check_integrity()
llm.llm_engine.shutdown()
print(json.dumps({"places": places, "tokens": [list(o.outputs[0].token_ids) for o in outputs]}))
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = os.getpid() % 100000
    a, b, net = f"pgA{tag}", f"pgB{tag}", f"10.231.{tag % 250}"
    try:
        _ip("netns", "add", a)
    except subprocess.CalledProcessError:
        pytest.skip("cannot create network namespaces here")
    procs: list[subprocess.Popen] = []
    temp = tempfile.mkdtemp(prefix="rn", dir="/tmp")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", f"{a}v", "type", "veth", "peer", "name", f"{b}v")
        for ns, host in ((a, 1), (b, 2)):
            _ip("link", "set", f"{ns}v", "netns", ns)
            _ip("-n", ns, "addr", "add", f"{net}.{host}/24", "dev", f"{ns}v")
            _ip("-n", ns, "link", "set", f"{ns}v", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        common = ["--block", "--num-cpus=1", "--disable-usage-stats", f"--object-store-memory={80 << 20}"]
        head = ["--head", "--port=6379", "--include-dashboard=false", f"--temp-dir={temp}/a"]
        for ns, host, extra in ((a, 1, head), (b, 2, [f"--address={net}.1:6379", f"--temp-dir={temp}/b"])):
            log = Path(temp) / f"{ns}.log"
            cmd = ["ip", "netns", "exec", ns, "ray", "start", f"--node-ip-address={net}.{host}", *common, *extra]
            with open(log, "w") as out:
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **RAY_ENV}, start_new_session=True
                    )
                )
            _wait_for(lambda log=log: "Ray runtime started" in log.read_text(), 60, procs[-1])
        yield a, net
    finally:
        for proc in reversed(procs):
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)


def test_tp2_across_two_network_hosts_matches_tp1(two_hosts, llama_model_dir):
    ns, net = two_hosts
    greedy = dict(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True)
    reference = LLM(str(llama_model_dir), **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    env = {**os.environ, **RAY_ENV, "RAY_ADDRESS": f"{net}.1:6379", "PAGEDLLM_RAY_PLACEMENT": "spread"}
    args = [json.dumps(PROMPTS), json.dumps(ENGINE), json.dumps(greedy)]
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-c", _DRIVER, str(llama_model_dir), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["places"] == [f"{net}.1", f"{net}.2"]  # one rank in each namespace
    assert got["tokens"] == [list(o.outputs[0].token_ids) for o in reference]
