"""The deployment files under deploy/ (and the Dockerfiles), and one live server they are tried against."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.openai.conftest import RemoteServer

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pagedllm.json"
API_KEY = "deploy-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 4096  # room for a request long enough that only an abort can end it early
METRIC_NAME = re.compile(r"\bvllm:[A-Za-z0-9_:]+")


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def serve_args(args: list[str]):
    """``args`` (what follows ``pagedllm serve``) parsed by the server's own parser: a typo fails here."""
    from pagedllm.entrypoints.cli import build_serve_parser

    return build_serve_parser("pagedllm serve").parse_args(args)


def metric_samples(server: RemoteServer) -> dict[tuple[str, frozenset], float]:
    """Every sample on the server's /metrics: (name, labels) -> value."""
    text = httpx.get(server.url_for("metrics"), timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(server: RemoteServer, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    found = [v for (n, ls), v in metric_samples(server).items() if n == name and set(labels.items()) <= ls]
    assert found, f"{name}{labels or ''} is not in /metrics"
    return sum(found)


def nudge(server: RemoteServer) -> None:
    """One 1-token request: the engine reports its gauges with a step's outputs, so an abort that
    leaves it idle shows in /metrics only after the next step."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    r = httpx.post(server.url_for("v1", "completions"), json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text


def assert_engine_idle(server: RemoteServer, idle_kv_usage: float, timeout: float = 15) -> None:
    """Every request finished or aborted and its KV blocks back in the pool: nothing running or
    waiting, KV usage where it was when the server was idle before."""
    deadline = time.monotonic() + timeout
    while True:
        nudge(server)
        state = [metric(server, f"vllm:{n}") for n in ("num_requests_running", "num_requests_waiting")]
        usage = metric(server, "vllm:kv_cache_usage_perc")
        if state == [0, 0] and usage == idle_kv_usage:
            return
        assert time.monotonic() < deadline, f"running/waiting {state}, KV usage {usage} (idle: {idle_kv_usage})"
        time.sleep(0.1)


class LiveServer:
    """A server for the deployment files, with its KV usage when idle (for the final check)."""

    def __init__(self, server: RemoteServer) -> None:
        self.server = server
        nudge(server)
        self.idle_kv_usage = metric(server, "vllm:kv_cache_usage_perc")

    def assert_idle(self) -> None:
        assert_engine_idle(self.server, self.idle_kv_usage)


@pytest.fixture(scope="session")
def live_server(tiny_model_dir):
    """One real ``pagedllm serve`` (tiny llama, served as "tiny", an API key) for the deploy tests."""
    model = tiny_model_dir("llama", max_position_embeddings=MAX_MODEL_LEN)
    with RemoteServer(model, ["--served-model-name", "tiny", "--api-key", API_KEY]) as srv:
        live = LiveServer(srv)
        yield live
        live.assert_idle()
