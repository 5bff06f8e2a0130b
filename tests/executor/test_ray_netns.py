"""Two real network hosts on one machine (``netns.py``): a Ray head in one namespace and a Ray node
in the other, the engine in the first. Needs root and iproute2; skipped otherwise."""

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

from .netns import two_namespaces
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


@pytest.fixture
def two_hosts():
    procs: list[subprocess.Popen] = []
    temp = tempfile.mkdtemp(prefix="rn", dir="/tmp")
    try:
        with two_namespaces() as (a, b, net):
            common = ["--block", "--num-cpus=1", "--disable-usage-stats", f"--object-store-memory={80 << 20}"]
            head = ["--head", "--port=6379", "--include-dashboard=false", f"--temp-dir={temp}/a"]
            for ns, host, extra in ((a, 1, head), (b, 2, [f"--address={net}.1:6379", f"--temp-dir={temp}/b"])):
                log = Path(temp) / f"{ns}.log"
                cmd = ["ip", "netns", "exec", ns, "ray", "start", f"--node-ip-address={net}.{host}", *common, *extra]
                with open(log, "w") as out:
                    procs.append(
                        subprocess.Popen(
                            cmd,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, **RAY_ENV},
                            start_new_session=True,
                        )
                    )
                _wait_for(lambda log=log: "Ray runtime started" in log.read_text(), 60, procs[-1])
            try:
                yield a, net
            finally:
                _stop(procs)
    finally:
        _stop(procs)
        shutil.rmtree(temp, ignore_errors=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


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
