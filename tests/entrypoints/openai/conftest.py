"""A real ``pagedllm serve`` process on a tiny model, for tests that use real clients."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: SIGKILL when the test process dies, so an interrupted run leaves no server."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class RemoteServer:
    """Starts ``python -m pagedllm.entrypoints.cli serve MODEL ARGS`` and waits for /health.

    ``entrypoint``: what follows ``python -m`` instead (e.g. ``["pagedllm.entrypoints.openai.api_server"]``);
    ``model_flag``: pass the model as ``--model MODEL`` (vLLM's module entry points) instead of positionally."""

    def __init__(
        self,
        model: str | Path,
        args: list[str] | None = None,
        start_timeout: float = 180,
        env: dict[str, str] | None = None,
        entrypoint: list[str] | None = None,
        model_flag: bool = False,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            *(entrypoint or ["pagedllm.entrypoints.cli", "serve"]),
            *(["--model", str(model)] if model_flag else [str(model)]),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *(args or []),
        ]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedllm-server-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self._wait_ready(start_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def url_for(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def openai_client(self, api_key: str = "EMPTY", **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kwargs)

    def async_openai_client(self, api_key: str = "EMPTY", **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kwargs)

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM, then SIGKILL the whole process group; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="module")
def server_model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(server_model_dir):
    """One server per test module, default flags, served model name 'tiny'."""
    with RemoteServer(server_model_dir, ["--served-model-name", "tiny"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    """The official OpenAI client pointed at the module's server."""
    return server.openai_client()


@pytest.fixture(scope="module")
def tokenizer(server_model_dir):
    from pagedllm.engine.tokenizer import load_tokenizer

    return load_tokenizer(str(server_model_dir))


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    """The response is ``status`` with an OpenAI error body; returns its ``error`` object."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error
