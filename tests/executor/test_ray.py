"""Tensor parallelism over Ray (``distributed_executor_backend="ray"``) on an in-process cluster of
two nodes (127.0.0.2 and 127.0.0.3: Linux routes all of 127/8 to the loopback interface, and Ray
keeps these addresses, unlike 127.0.0.1). One cluster serves the whole module: starting one is
seconds of both cores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.executor.multiproc import WorkerDiedError

from .test_multiproc import ENGINE, GREEDY, PROMPTS, _all_gone, _min_top2_gap, _run

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

HEAD, OTHER = "127.0.0.2", "127.0.0.3"


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        mp.setenv("RAY_AUTH_MODE", "disabled")  # else Ray 2.60 leaves a token that later clusters demand
        node = dict(num_cpus=2, object_store_memory=80 << 20)
        c = cluster_utils.Cluster(
            initialize_head=True, head_node_args=dict(node_ip_address=HEAD, include_dashboard=False, **node)
        )
        try:
            c.add_node(node_ip_address=OTHER, **node)
            ray.init(address=c.address, _node_ip_address=HEAD)
            yield c
        finally:
            ray.shutdown()
            c.shutdown()


@pytest.fixture(scope="module")
def reference(llama_model_dir):
    llm = LLM(str(llama_model_dir), **ENGINE)
    assert _min_top2_gap(llm) > 1e-4  # no near-ties: TP's other summation order cannot flip a token
    return _run(llm, rounds=1)


def _ray_llm(model_dir) -> LLM:
    return LLM(str(model_dir), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)


def _stopped(llm: LLM) -> None:
    """Shut down; the actors' processes exit and the placement group is removed."""
    executor = llm.llm_engine.engine_core.executor
    procs = [psutil.Process(p.pid) for p in executor.places]
    llm.llm_engine.shutdown()
    assert _all_gone(procs, timeout=10)
    assert all(ray.util.placement_group_table(pg)["state"] == "REMOVED" for pg in executor.pgs)


def test_ray_tp2_packed_matches_tp1(cluster, reference, llama_model_dir):
    llm = _ray_llm(llama_model_dir)
    try:
        places = llm.llm_engine.engine_core.executor.places
        assert [p.node_ip for p in places] == [HEAD, HEAD]  # PACK: both on the engine core's node
        assert all(p.pid != os.getpid() for p in places)
        assert _run(llm, rounds=1) == reference
        llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8, seed=3), use_tqdm=False)
        llm.llm_engine.check_integrity()
    finally:
        _stopped(llm)


def test_ray_tp2_spread_over_two_nodes_matches_tp1(cluster, reference, llama_model_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_RAY_PLACEMENT", "spread")
    llm = _ray_llm(llama_model_dir)
    try:
        places = llm.llm_engine.engine_core.executor.places
        assert [p.node_ip for p in places] == [HEAD, OTHER]  # rank 0 beside the engine core
        assert _run(llm, rounds=1) == reference  # gloo between the nodes, no shared memory
        llm.llm_engine.check_integrity()
    finally:
        _stopped(llm)


@pytest.mark.parametrize("placement", ["pack", "spread"])  # shared memory / gloo between the ranks
def test_ray_actor_killed_mid_generation_raises_naming_the_rank(cluster, llama_model_dir, monkeypatch, placement):
    monkeypatch.setenv("PAGEDLLM_RAY_PLACEMENT", placement)
    llm = _ray_llm(llama_model_dir)
    engine, executor = llm.llm_engine, llm.llm_engine.engine_core.executor
    procs = [psutil.Process(p.pid) for p in executor.places]
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    engine.step()  # requests in flight
    os.kill(procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 .*died"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 15
    assert _all_gone(procs, timeout=10)  # the surviving rank is killed too
    assert ray.util.placement_group_table(executor.pgs[0])["state"] == "REMOVED"
    llm.llm_engine.shutdown()  # idempotent


def test_worker_value_error_reaches_the_caller(cluster, llama_model_dir):
    with pytest.raises(ValueError, match=r"num_gpu_blocks_override=2 cannot hold .*tensor-parallel rank [01]"):
        LLM(str(llama_model_dir), tensor_parallel_size=2, distributed_executor_backend="ray", num_gpu_blocks_override=2)
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_unplaceable_spread_is_a_clear_error(cluster, llama_model_dir, monkeypatch):
    """Four ranks, one per node, on two nodes."""
    monkeypatch.setenv("PAGEDLLM_RAY_PLACEMENT", "spread")
    monkeypatch.setattr("pagedllm.executor.ray_executor._PLACEMENT_TIMEOUT_S", 2.0)
    with pytest.raises(ValueError, match="cannot place 4 rank"):
        LLM(str(llama_model_dir), tensor_parallel_size=4, distributed_executor_backend="ray", **ENGINE)
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


_DRIVER = """
import sys
from pagedllm import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray")
print(*(p.pid for p in llm.llm_engine.engine_core.executor.places), flush=True)
sys.stdin.read()
"""


def test_actors_die_with_a_killed_engine(cluster, llama_model_dir):
    """Ray's actors (not detached) go with their driver, however it dies."""
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    cmd = [sys.executable, "-c", _DRIVER, str(llama_model_dir)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
    try:
        assert proc.stdout is not None
        actors = [psutil.Process(int(pid)) for pid in proc.stdout.readline().split()]
        assert len(actors) == 2 and all(a.pid != proc.pid for a in actors)
        proc.kill()
        proc.wait(5)
        assert _all_gone(actors, timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
