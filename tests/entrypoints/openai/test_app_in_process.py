"""The real app (``build_app`` with its real handlers) on a recording fake engine, in process:
the seams the server split made (one chat renderer, one model check, the typed engine client,
the watchdog apart from the app)."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from argparse import Namespace
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from pagedllm.entrypoints.chat_utils import render_chat_ids
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.engine_client import EngineClient
from pagedllm.outputs import CompletionOutput, RequestOutput

# Renders tools and a template kwarg, so dropping either changes the ids.
TEMPLATE = (
    "{{- bos_token -}}{%- if tools -%}{{- 'tools:' -}}"
    "{%- for t in tools -%}{{- ' ' + t['function']['name'] -}}{%- endfor -%}{{- '\\n' -}}{%- endif -%}"
    "{%- if persona -%}{{- 'persona: ' + persona + '\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "weather"}, {"type": "text", "text": "in Paris?"}]}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
KWARGS = {"persona": "forecaster"}


class RecordingEngine:
    """Enough of an EngineClient for the app: generate records each prompt and finishes at once."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=4),
            model_config=SimpleNamespace(
                max_model_len=512, model="/m", arch=SimpleNamespace(vocab_size=len(tokenizer))
            ),
        )
        self.stat_loggers: list = []
        self.is_running = True
        self.capacity: dict = {}
        self.prompts: list = []

    async def generate(self, prompt, sampling_params, request_id, priority=0, cache_salt=None, strict_max_tokens=True):
        self.prompts.append(prompt)
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else self.tokenizer.encode(prompt)
        yield RequestOutput(request_id, None, ids, None, [CompletionOutput(0, "ok", [5], finish_reason="length")], True)

    async def abort(self, request_id: str) -> None:
        pass

    async def check_structured_outputs(self, params) -> None:
        pass

    async def check_health(self) -> None:
        pass

    def get_num_unfinished_requests(self) -> int:
        return 0

    def shutdown(self) -> None:
        self.is_running = False


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from pagedllm.engine.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_model_dir("llama")))


@pytest.fixture()
def app_engine(tokenizer):
    engine = RecordingEngine(tokenizer)
    args = Namespace(
        served_model_name=["m", "m2"], chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    with TestClient(build_app(engine, args), raise_server_exceptions=False) as client:
        yield client, engine


def test_tokenize_returns_exactly_the_ids_chat_sends(app_engine, tokenizer):
    client, engine = app_engine
    fields = {"messages": MESSAGES, "tools": TOOLS, "chat_template_kwargs": KWARGS}
    tok = client.post("/tokenize", json=fields)
    assert tok.status_code == 200, tok.text
    chat = client.post("/v1/chat/completions", json={**fields, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    sent = engine.prompts[-1]["prompt_token_ids"]
    assert tok.json()["tokens"] == sent
    assert chat.json()["usage"]["prompt_tokens"] == tok.json()["count"] == len(sent)
    # ... and they are the shared renderer's ids, with the tools and the kwarg in them
    template_messages = [{"role": "user", "content": "weather\nin Paris?"}]
    assert sent == render_chat_ids(
        tokenizer, template_messages, chat_template=TEMPLATE, tools=TOOLS, chat_template_kwargs=KWARGS
    )
    text = tokenizer.decode(sent)
    assert "tools: get_weather" in text and "persona: forecaster" in text and "weather\nin Paris?" in text
    plain = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert plain != sent  # without tools and kwargs the template renders differently


def test_tokenize_and_chat_agree_on_tool_choice_none_and_bad_kwargs(app_engine):
    client, engine = app_engine
    fields = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}
    tok = client.post("/tokenize", json=fields).json()
    assert client.post("/v1/chat/completions", json={**fields, "max_tokens": 1}).status_code == 200
    assert tok["tokens"] == engine.prompts[-1]["prompt_token_ids"]
    assert "get_weather" not in client.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    for path in ("/tokenize", "/v1/chat/completions"):
        resp = client.post(path, json={"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template_kwargs", resp.text


def test_one_model_check_one_404(app_engine):
    client, _ = app_engine
    requests = [
        ("post", "/v1/chat/completions", {"model": "nope", "messages": MESSAGES}),
        ("post", "/v1/completions", {"model": "nope", "prompt": "hi"}),
        ("post", "/tokenize", {"model": "nope", "prompt": "hi"}),
        ("post", "/detokenize", {"model": "nope", "tokens": [1]}),
        ("get", "/v1/models/nope", None),
    ]
    bodies = []
    for method, path, body in requests:
        resp = client.request(method, path, json=body)
        assert resp.status_code == 404, (path, resp.text)
        bodies.append(resp.json())
    assert all(b == bodies[0] for b in bodies), bodies
    assert bodies[0] == {
        "error": {
            "message": "The model `nope` does not exist; this server serves `m`, `m2`.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert client.post("/v1/completions", json={"model": "m2", "prompt": "hi"}).json()["model"] == "m2"
    assert client.get("/v1/models/m2").json()["id"] == "m2"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "x", "add_special_tokens": "maybe"}, "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "", "content": "x"}]}, "messages.0.role"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
        ("/detokenize", {"tokens": [1, "a"]}, "tokens.1"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_tokenizer_routes_take_typed_bodies(app_engine, path, body, param):
    client, _ = app_engine
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError" and error["message"], error


def test_async_llm_provides_every_engine_client_member():
    from pagedllm.engine.async_llm import AsyncLLM

    init = inspect.getsource(AsyncLLM.__init__)
    members = {n for n in vars(EngineClient) if not n.startswith("_")} | set(EngineClient.__annotations__)
    assert {"generate", "abort", "tokenizer", "is_running", "config", "check_health"} <= members
    missing = [n for n in members if not hasattr(AsyncLLM, n) and f"self.{n}" not in init]
    assert not missing
    for name in members:
        proto = vars(EngineClient).get(name)
        if inspect.isfunction(proto):
            assert (
                inspect.signature(getattr(AsyncLLM, name)).parameters.keys()
                == inspect.signature(proto).parameters.keys()
            ), name


def test_watchdog_ignores_an_engine_stopped_on_purpose(app_engine):
    from pagedllm.entrypoints.openai import server_process

    client, engine = app_engine
    state = client.app.state.server_state
    server = SimpleNamespace(should_exit=False, config=SimpleNamespace(timeout_graceful_shutdown=30))
    state.stop_engine()  # what the lifespan does on SIGTERM: is_running goes False
    asyncio.run(asyncio.wait_for(server_process.watch_engine(state, server), 2))
    assert not state.engine_dead and state.exit_code == 0 and not server.should_exit


def test_docs_can_be_disabled(tokenizer):
    for disabled, status in ((False, 200), (True, 404)):
        app = build_app(RecordingEngine(tokenizer), Namespace(served_model_name=["m"], disable_fastapi_docs=disabled))
        with TestClient(app, raise_server_exceptions=False) as client:
            for path in ("/docs", "/redoc", "/openapi.json"):
                assert client.get(path).status_code == status, (disabled, path)


def test_a_batch_is_held_to_half_the_admission_limit(tokenizer):
    """Each prompt is an engine request and the gate counts them: a batch the server allows must
    leave the other half of the admission limit (here 4 running + 4 waiting) to other clients."""
    engine = RecordingEngine(tokenizer)
    app = build_app(engine, Namespace(served_model_name=["m"], max_waiting_requests=4, max_prompts_per_request=100))
    with TestClient(app, raise_server_exceptions=False) as client:
        resp = client.post("/v1/completions", json={"prompt": ["a"] * 5})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
        assert "at most 4" in resp.json()["error"]["message"] and "half" in resp.json()["error"]["message"]
        engine.get_num_unfinished_requests = lambda: 4  # an allowed batch of 4 is in the engine
        assert client.post("/v1/completions", json={"prompt": "a"}).status_code == 200
        assert client.post("/v1/completions", json={"prompt": ["a"] * 4}).status_code == 200


def test_openapi_documents_every_request_body(tokenizer):
    """The routes read their bodies themselves; /openapi.json still gives each POST route its
    JSON body schema (clients, code generators and fuzzers read it), every $ref resolvable."""
    app = build_app(RecordingEngine(tokenizer), Namespace(served_model_name=["m"]))
    with TestClient(app) as client:
        schema = client.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, methods in schema["paths"].items():
        if "post" in methods and path != "/ping":
            body = methods["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert body.get("properties") or body.get("anyOf"), path
    completion = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "max_tokens", "n", "stream"} <= set(completion["properties"])
    invocations = schema["paths"]["/invocations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert len(invocations["anyOf"]) == 2  # a chat or a completion request
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(schema)))
    assert refs and refs <= set(components), refs - set(components)


def test_a_client_gone_before_its_body_is_read_is_a_499_not_a_500(tokenizer):
    """Under load a client may hang up before the server reads its body: that is the client's
    doing (499, as a hang-up later on), not an unhandled error logged with a traceback as a 500."""
    app = build_app(RecordingEngine(tokenizer), Namespace(served_model_name=["m"]))
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert app.state.server_state.errors.counts == {499: 1}
