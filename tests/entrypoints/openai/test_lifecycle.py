"""``pagedllm serve`` as a process: help, start-up output and errors, SIGTERM drain, engine death.

No orphans: every descendant of the server (engine core, multiprocessing's resource tracker)
must be gone once the server has exited. psutil is not a dependency: /proc is read directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import RemoteServer, free_port

CLI = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
SERVE_FLAGS = [
    "--host",
    "--port",
    "--served-model-name",
    "--api-key",
    "--api-key-file",
    "--chat-template",
    "--uvicorn-log-level",
    "--disable-uvicorn-access-log",
    "--shutdown-timeout",
    "--max-waiting-requests",
    "--max-prompts-per-request",
    "--max-request-body-bytes",
    "--timeout-keep-alive",
    "--header-read-timeout",
    "--disable-fastapi-docs",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--kv-cache-memory",
    "--gpu-memory-utilization",
    "--dtype",
    "--load-format",
    "--seed",
    "--tensor-parallel-size",
    "--data-parallel-size",
    "--block-size",
    "--tokenizer",
    "--device",
    "--trust-remote-code",
]
# Long enough that a signal sent after the first chunk lands mid-stream, short enough to drain
# quickly even on a loaded CPU (the SIGTERM test gives it --shutdown-timeout 120).
DRAIN_REQUEST = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True, "stream": True}
KILL_REQUEST = {**DRAIN_REQUEST, "max_tokens": 2000}


# ---------------------------------------------------------------------------------- /proc helpers
def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    stack = [pid]
    while stack:
        for children in Path(f"/proc/{stack.pop()}/task").glob("*/children"):
            try:
                kids = {int(k) for k in children.read_text().split()}
            except OSError:
                continue
            stack += sorted(kids - found)
            found |= kids
    return found


def is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has exited


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def engine_pid(server_pid: int) -> int:
    engines = [p for p in descendants(server_pid) if "spawn_main" in cmdline(p)]
    assert len(engines) == 1, [cmdline(p) for p in descendants(server_pid)]
    return engines[0]


def assert_all_gone(pids: set[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [cmdline(p) for p in pids if is_alive(p)], "orphaned child processes"


def data_events(lines) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def first_event(lines) -> str:
    return next(line for line in lines if line.startswith("data: "))


@pytest.fixture(scope="module")
def long_model_dir(tiny_model_dir) -> Path:
    """Room for long streams, so a signal surely lands mid-stream."""
    return tiny_model_dir("llama", max_position_embeddings=2048)


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------- CLI
def test_help_lists_every_flag():
    top = run_cli("--help")
    assert top.returncode == 0 and "serve" in top.stdout and "generate" in top.stdout
    serve = run_cli("serve", "--help")
    assert serve.returncode == 0
    missing = [flag for flag in SERVE_FLAGS if flag not in serve.stdout]
    assert not missing
    assert "vllm:" in serve.stdout  # the metric prefix is documented


def test_indivisible_tensor_parallel_is_a_clear_startup_error(server_model_dir):
    proc = run_cli("serve", str(server_model_dir), "--port", str(free_port()), "--tensor-parallel-size", "3")
    assert proc.returncode == 2
    assert "valid sizes" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_flags_exit_2(server_model_dir, tmp_path):
    assert run_cli("serve", "--port", "eighty").returncode == 2
    missing = run_cli("serve", str(tmp_path / "no-such-model"))
    assert missing.returncode == 2 and "not a local directory" in missing.stderr
    keys = run_cli("serve", str(server_model_dir), "--api-key-file", str(tmp_path / "nokeys"))
    assert keys.returncode == 2 and "api-key-file" in keys.stderr and "Traceback" not in keys.stderr


def test_busy_port_exits_2(server_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_cli("serve", str(server_model_dir), "--host", "127.0.0.1", "--port", str(port))
    assert proc.returncode == 2 and f"127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------- lifecycle
def test_sigterm_drains_streaming_request(long_model_dir):
    srv = RemoteServer(long_model_dir, ["--served-model-name", "tiny", "--shutdown-timeout", "120"])
    try:
        log = srv.log()
        assert "capacity:" in log and "KV blocks" in log and "requests of max_model_len=2048 fit" in log
        assert f"http://127.0.0.1:{srv.port}" in log and "LlamaForCausalLM" in log
        assert "start-up " in log and "engine process " in log and "weights " in log and "intra-op threads: " in log
        children = descendants(srv.proc.pid)
        engine_pid(srv.proc.pid)
        with httpx.stream("POST", srv.url_for("v1", "completions"), json=DRAIN_REQUEST, timeout=120) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert '"text"' in first_event(lines)
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(srv.url_for("health"), timeout=2)
            events = data_events(lines)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(120) == 0
        assert "server stopped (exit code 0)" in srv.log()
        assert_all_gone(children)
    finally:
        srv.stop()


def test_engine_death_fails_requests_and_exits_nonzero(long_model_dir):
    srv = RemoteServer(long_model_dir, ["--served-model-name", "tiny"])
    try:
        children = descendants(srv.proc.pid)
        engine = engine_pid(srv.proc.pid)
        with httpx.stream("POST", srv.url_for("v1", "completions"), json=KILL_REQUEST, timeout=30) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert '"text"' in first_event(lines)
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            try:
                events = data_events(lines)
            except httpx.HTTPError:  # a broken stream is an acceptable failure too
                events = ["<broken>"]
            failed_after = time.monotonic() - killed
        assert failed_after < 3, failed_after
        assert not any('"finish_reason":"length"' in e for e in events)
        assert events == ["<broken>"] or any('"error"' in e for e in events), events[-3:]
        with contextlib.suppress(httpx.ConnectError):  # already gone: also "not ready"
            assert httpx.get(srv.url_for("health"), timeout=2).status_code == 503
        assert srv.proc.wait(10) == 1
        assert "engine core" in srv.log()
        assert_all_gone(children)
    finally:
        srv.stop()


def test_sigkill_leaves_no_socket_files(server_model_dir, tmp_path):
    """The engine's ZMQ ipc:// sockets live in a private temp directory that is removed once the
    engine has connected: a server SIGKILLed (no clean-up runs) leaves no socket files behind."""
    srv = RemoteServer(server_model_dir, ["--served-model-name", "tiny"], env={"TMPDIR": str(tmp_path)})
    try:
        children = descendants(srv.proc.pid)
        engine_pid(srv.proc.pid)
        client = srv.openai_client()
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=1).choices  # the sockets work
        srv.proc.kill()
        assert srv.proc.wait(10) == -signal.SIGKILL
        assert_all_gone(children)  # the engine dies with its parent (PR_SET_PDEATHSIG)
        assert not [p for p in tmp_path.rglob("*") if p.is_socket()]
        assert not list(tmp_path.glob("pagedllm-*"))
    finally:
        srv.stop()
