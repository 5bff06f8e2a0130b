"""Server infrastructure on a real ``pagedllm serve`` process: models, tokenize, errors, auth, metrics, overload.

One server for the module: API keys on (k1 via --api-key, k2 via --api-key-file) and a tiny
admission limit (--max-num-seqs 1 --max-waiting-requests 1: at most 2 generation requests at once).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.entrypoints.openai.api_keys import KeyRing, load_api_keys

from .conftest import RemoteServer, assert_openai_error

K1, K2 = "sk-key-one", "sk-key-two"
AUTH = {"Authorization": f"Bearer {K1}"}

METRIC_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
]


@pytest.fixture(scope="module")
def srv(server_model_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# comment\n\n{K2}\n")
    args = [
        "--served-model-name",
        "tiny",
        "tiny-alias",
        "--api-key",
        K1,
        "--api-key-file",
        str(key_file),
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "1",
        "--disable-uvicorn-access-log",
    ]
    with RemoteServer(server_model_dir, args) as server:
        yield server


@pytest.fixture()
def client(srv):
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        yield c


# ---------------------------------------------------------------------------------- info routes
def test_models_shape(client, server_model_dir):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny", "tiny-alias"]
    for card in body["data"]:
        assert card["object"] == "model" and card["owned_by"] == "pagedllm"
        assert isinstance(card["created"], int) and card["root"] == str(server_model_dir)
        assert card["max_model_len"] == 512
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert_openai_error(client.get("/v1/models/nope"), 404)


def test_openai_client_lists_models(srv):
    assert [m.id for m in srv.openai_client(api_key=K2).models.list()] == ["tiny", "tiny-alias"]


def test_version_and_health(srv):
    import pagedllm

    assert httpx.get(srv.url_for("version")).json() == {"version": pagedllm.__version__}
    assert httpx.get(srv.url_for("health")).status_code == 200


def test_tokenize_detokenize_round_trip(client):
    tok = client.post("/tokenize", json={"model": "tiny", "prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 512
    plain = client.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert tok["tokens"][1:] == plain["tokens"]  # the default adds BOS
    assert client.post("/detokenize", json={"tokens": plain["tokens"]}).json() == {"prompt": "Hello world"}


def test_tokenize_messages_uses_chat_template(client):
    messages = [{"role": "user", "content": "hi there"}]
    tok = client.post("/tokenize", json={"messages": messages}).json()
    text = client.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == "<|begin_of_text|><|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    no_gen = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_gen["count"] < tok["count"]


# ---------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions", "/v1/chat/completions"])
def test_malformed_json_is_400(client, path):
    resp = client.post(path, content=b'{"prompt": ', headers={"Content-Type": "application/json"})
    assert "JSON" in assert_openai_error(resp, 400)["message"]
    assert_openai_error(client.post(path, json=[1, 2]), 400)


def test_wrong_types_are_400(client):
    assert assert_openai_error(client.post("/detokenize", json={"tokens": "abc"}), 400)["param"] == "tokens"
    assert_openai_error(client.post("/detokenize", json={"tokens": [10**9]}), 400)
    assert_openai_error(client.post("/tokenize", json={"prompt": 12}), 400)
    assert_openai_error(client.post("/tokenize", json={}), 400)
    assert_openai_error(client.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404)
    assert_openai_error(client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": "x"}), 400)


def test_unknown_route_and_method(client):
    assert "not a route" in assert_openai_error(client.get("/v2/nothing"), 404)["message"]
    assert_openai_error(client.delete("/v1/models"), 405)


# ---------------------------------------------------------------------------------- auth
def test_api_keys(srv):
    url = srv.url_for("v1", "models")
    assert_openai_error(httpx.get(url), 401)
    assert_openai_error(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(httpx.get(url, headers={"Authorization": K1}), 401)  # no Bearer scheme
    assert_openai_error(httpx.post(srv.url_for("tokenize"), json={"prompt": "x"}), 401)
    assert_openai_error(httpx.post(srv.url_for("v1", "completions"), json={}), 401)
    for key in (K1, K2):
        assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    for open_path in ("health", "metrics", "version"):
        assert httpx.get(srv.url_for(open_path)).status_code == 200


def test_key_helpers(tmp_path):
    ring = KeyRing(load_api_keys(["b", "a"], None))
    assert ring.match("a") is ring.keys[1] and ring.match("ab") is None and KeyRing([]).match("") is None
    path = tmp_path / "keys"
    path.write_text("x\n  y  \n#z\n")
    assert [k.secret for k in load_api_keys(["w"], str(path))] == [b"w", b"x", b"y"]
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(None, str(tmp_path / "missing"))


# ---------------------------------------------------------------------------------- metrics
def test_metrics_parse_and_count(client):
    resp = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 5, "ignore_eos": True}
    )
    assert resp.status_code == 200, resp.text
    text = httpx.get(client.base_url.join("/metrics")).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if family.name != "vllm:cache_config_info":  # an info series: the cache config's labels, as vLLM's
                assert s.labels["model_name"] == "tiny"
            samples.setdefault(s.name, []).append(s)
    for name in METRIC_NAMES:
        assert name in samples, name
    assert samples["vllm:generation_tokens_total"][0].value >= 5
    assert samples["vllm:prompt_tokens_total"][0].value >= 2
    length = [s for s in samples["vllm:request_success_total"] if s.labels["finished_reason"] == "length"]
    assert length[0].value >= 1
    assert samples["vllm:e2e_request_latency_seconds_count"][0].value >= 1


# ---------------------------------------------------------------------------------- overload
def test_overload_gets_503_with_retry_after(srv):
    """Limit 1 running + 1 waiting: of 5 concurrent long requests at least 3 are refused at once."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> tuple[int, str | None]:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code == 200:
                async for _ in resp.aiter_lines():  # hold the slot until the first chunk
                    break
            else:
                await resp.aread()
                assert_openai_error(resp, resp.status_code)
            return resp.status_code, resp.headers.get("retry-after")

    async def main() -> list[tuple[int, str | None]]:
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=30) as c:
            return await asyncio.gather(*[one(c) for _ in range(5)])

    results = asyncio.run(main())
    refused = [r for r in results if r[0] == 503]
    assert len(refused) >= 3, results
    assert all(r[1] is not None and int(r[1]) >= 1 for r in refused)
    assert [r[0] for r in results].count(200) >= 1
    # the aborted streams free their slots: the server admits requests again
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        for _ in range(50):
            resp = c.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            if resp.status_code == 200:
                break
            time.sleep(0.1)
        assert resp.status_code == 200, resp.text
        assert json.loads(resp.text)["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------------- in process
class FakeEngine:
    """Just enough of AsyncLLM for build_app; health and liveness are switchable."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=1), model_config=SimpleNamespace(max_model_len=64, model="/m")
        )
        self.stat_loggers: list = []
        self.is_running = True
        self.healthy = True
        self.shutdowns = 0

    async def check_health(self) -> None:
        from pagedllm.engine.core_client import EngineDeadError

        if not (self.healthy and self.is_running):
            raise EngineDeadError("engine down")

    def get_num_unfinished_requests(self) -> int:
        return 0

    def shutdown(self) -> None:
        self.shutdowns += 1


VALID = {"prompt": "x"}


class FailingHandler:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def create_completion(self, body, raw_request):
        raise self.exc


@pytest.fixture()
def fake_app(monkeypatch):
    from argparse import Namespace

    from pagedllm.entrypoints.openai import api_server

    monkeypatch.setattr(api_server, "_load_handlers", lambda engine, options, served: {})
    engine = FakeEngine()
    return api_server.build_app(engine, Namespace(served_model_name=["m"])), engine


def test_health_and_error_mapping_in_process(fake_app):
    from fastapi.testclient import TestClient

    from pagedllm.engine.core_client import EngineDeadError

    app, engine = fake_app
    state = app.state.server_state
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/health").status_code == 200
        engine.healthy = False
        assert_openai_error(c.get("/health"), 503)
        assert len(engine.stat_loggers) == 1  # build_app added a Prometheus logger
        assert_openai_error(c.post("/v1/completions", json={}), 501)
        # the body is validated before a handler runs: these carry a valid one
        state.handlers["completion"] = FailingHandler(EngineDeadError("gone"))
        assert "gone" in assert_openai_error(c.post("/v1/completions", json=VALID), 500)["message"]
        state.handlers["completion"] = FailingHandler(KeyError("bug"))
        assert "KeyError" in assert_openai_error(c.post("/v1/completions", json=VALID), 500)["message"]
    assert engine.shutdowns == 1  # the lifespan stops the engine


def test_watchdog_stops_server_when_engine_dies(fake_app):
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai import server_process

    app, engine = fake_app
    state = app.state.server_state
    server = SimpleNamespace(should_exit=False, config=SimpleNamespace(timeout_graceful_shutdown=30))

    async def scenario() -> None:
        watchdog = asyncio.create_task(server_process.watch_engine(state, server))
        await asyncio.sleep(0.3)
        assert not server.should_exit
        engine.is_running = False
        await asyncio.wait_for(watchdog, 2)

    asyncio.run(scenario())
    assert state.engine_dead and state.exit_code == 1 and server.should_exit
    assert server.config.timeout_graceful_shutdown == server_process.DEAD_ENGINE_GRACE_S
