"""``pagedllm serve --data-parallel-size 2``: two engine cores behind one server give the same
greedy tokens as one engine (float32), each core has its own metric series, SIGTERM drains and
stops every core, and SIGKILL of one core takes the whole server down fast with nothing left
behind. Two servers (each engine process costs start-up time): the module's, stopped by the
SIGTERM test, and the kill test's own."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedllm import LLM, SamplingParams

from .conftest import RemoteServer
from .test_lifecycle import assert_all_gone, cmdline, data_events, descendants, first_event

_PREFIX = "the quick brown fox jumps over the lazy dog "
PROMPTS = [
    _PREFIX + "and then",
    _PREFIX + "while the cat",
    _PREFIX + "so",
    "hello world",
    "one two three four five six seven eight nine ten",
    "a b c d e f g",
    "zebra",
    "Once upon a time there was",
]
MAX_TOKENS = 16
ENGINE = dict(dtype="float32", block_size=8, max_model_len=256, max_num_seqs=8)
FLAGS = ["--dtype", "float32", "--block-size", "8", "--max-model-len", "256", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def dp_server(server_model_dir):
    args = ["--served-model-name", "tiny", "--data-parallel-size", "2", *FLAGS]
    with RemoteServer(server_model_dir, args) as srv:
        yield srv


def _engine_pids(server_pid: int) -> list[int]:
    return sorted(p for p in descendants(server_pid) if "spawn_main" in cmdline(p))


def _complete(srv: RemoteServer, prompt: str) -> dict:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    resp = httpx.post(srv.url_for("v1", "completions"), json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def _reference(model_dir) -> list[tuple[list[int], list[int]]]:
    """One engine (data_parallel_size=1), in process: (prompt ids, greedy ids) per prompt; no near-ties."""
    llm = LLM(str(model_dir), **ENGINE)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        gaps = [
            top[0] - top[1]
            for o in outputs
            for position in o.outputs[0].logprobs or []
            for top in [sorted((lp.logprob for lp in position.values()), reverse=True)]
        ]
        assert min(gaps) > 1e-4, min(gaps)  # exact match is meaningful only without near-ties
        llm.llm_engine.check_integrity()
        return [(list(o.prompt_token_ids or []), list(o.outputs[0].token_ids)) for o in outputs]
    finally:
        llm.llm_engine.shutdown()


def _series(srv: RemoteServer, name: str) -> dict[str, float]:
    """engine label -> value of the metric ``name``."""
    text = httpx.get(srv.url_for("metrics"), timeout=10).text
    pattern = re.compile(rf'^{re.escape(name)}\{{[^}}]*engine="(\d+)"[^}}]*\}} (\S+)$', re.M)
    return {engine: float(value) for engine, value in pattern.findall(text)}


def test_two_engine_cores_match_one_token_for_token(dp_server, server_model_dir):
    assert len(_engine_pids(dp_server.proc.pid)) == 2
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all in flight at once: both cores get work
        choices = list(pool.map(lambda p: _complete(dp_server, p), PROMPTS))
    got = [(c["prompt_token_ids"], c["token_ids"]) for c in choices]
    assert got == _reference(server_model_dir)
    generated = _series(dp_server, "vllm:generation_tokens_total")
    assert set(generated) == {"0", "1"} and all(v > 0 for v in generated.values()), generated
    assert sum(generated.values()) == len(PROMPTS) * MAX_TOKENS
    for prompt in PROMPTS[:3]:  # the shared-prefix prompts went to one core, and come back to it
        assert _cached_tokens(dp_server, prompt) >= 8, prompt
    # Every request's KV blocks went back to its core's pool (the server-side integrity view).
    deadline = time.monotonic() + 10
    while any(_series(dp_server, "vllm:kv_cache_usage_perc").values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _series(dp_server, "vllm:kv_cache_usage_perc") == {"0": 0.0, "1": 0.0}


def _cached_tokens(srv: RemoteServer, prompt: str) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    resp = httpx.post(srv.url_for("v1", "completions"), json=body, timeout=60)
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_prefix_returns_to_its_core_though_another_is_as_idle(dp_server):
    """Core 0 busy: the prompt goes to core 1. Both idle: load alone would pick core 0 (ties go
    to the lowest index); affinity sends the next prompt with that first block to core 1."""
    busy = {"model": "tiny", "prompt": "x", "max_tokens": 150, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", dp_server.url_for("v1", "completions"), json=busy, timeout=120) as resp:
        lines = resp.iter_lines()
        assert '"text"' in first_event(lines)
        assert _series(dp_server, "vllm:num_requests_running") == {"0": 1.0, "1": 0.0}
        assert _cached_tokens(dp_server, "zulu yankee xray whiskey one") == 0  # to core 1
        assert data_events(lines)[-1] == "[DONE]"
    assert _cached_tokens(dp_server, "zulu yankee xray whiskey two") >= 8


def test_each_core_has_its_own_labelled_series(dp_server):
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total"):
        assert set(_series(dp_server, name)) == {"0", "1"}, name
    assert set(_series(dp_server, "vllm:cache_config_info")) == {"0", "1"}
    assert "2 data-parallel engine cores, each: " in dp_server.log()
    assert "[engine0]" in dp_server.log() and "[engine1]" in dp_server.log()
    assert "intra-op threads: 1 (OMP_NUM_THREADS=1)" in dp_server.log()  # 2 cores split between 2 engines
    assert httpx.get(dp_server.url_for("health"), timeout=10).status_code == 200


def test_sigterm_drains_and_stops_every_core(dp_server):
    """Runs after the others: it stops the module's server."""
    children = descendants(dp_server.proc.pid)
    assert len(_engine_pids(dp_server.proc.pid)) == 2
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", dp_server.url_for("v1", "completions"), json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        assert '"text"' in first_event(lines)
        dp_server.proc.send_signal(signal.SIGTERM)
        events = data_events(lines)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert dp_server.proc.wait(60) == 0
    assert_all_gone(children)


def test_sigkill_of_one_core_stops_the_server_within_5_s(server_model_dir, tmp_path):
    args = ["--served-model-name", "tiny", "--data-parallel-size", "2", *FLAGS]
    with RemoteServer(server_model_dir, args, env={"TMPDIR": str(tmp_path)}) as srv:
        _kill_one_core(srv)
        assert not list(tmp_path.glob("pagedllm-*"))  # no socket directories left


def _kill_one_core(dp_server: RemoteServer) -> None:
    children = descendants(dp_server.proc.pid)
    victim = _engine_pids(dp_server.proc.pid)[1]
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    health = []
    while dp_server.proc.poll() is None and time.monotonic() - killed < 10:
        try:
            health.append(httpx.get(dp_server.url_for("health"), timeout=1).status_code)
        except httpx.HTTPError:
            health.append("down")
        time.sleep(0.05)
    code = dp_server.proc.wait(10)
    exited_after = time.monotonic() - killed
    assert code == 1 and exited_after <= 5.0, (code, exited_after)
    with pytest.raises(httpx.ConnectError):
        httpx.get(dp_server.url_for("health"), timeout=1)
    failing = health[health.index(503) :] if 503 in health else []
    assert set(failing) <= {503, "down"}, health  # once failing, /health never recovered
    assert "engine core 1 of 2 died (exit code -9)" in dp_server.log()
    assert_all_gone(children, timeout=1.0)
