"""Structured output and tool calling on a real ``pagedllm serve`` process, with the official client.

The tiny model's weights are random, so every valid JSON document, regex match or tool call
below is the constraint's doing. One server for the module, with --enable-auto-tool-choice
--tool-call-parser hermes; the last test checks the engine is idle and its pool intact.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM

from .conftest import RemoteServer
from .test_concurrency import metric

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"$ref": "#/$defs/unit"},
    },
    "required": ["city", "days"],
    "$defs": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": "string", "pattern": "^UTC[+-][0-9]$"}},
                "required": ["tz"],
            },
        },
    },
]
PARAMS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def srv(server_model_dir):
    args = [
        "--served-model-name",
        "tiny",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--disable-uvicorn-access-log",
    ]
    with RemoteServer(server_model_dir, args) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    return srv.openai_client()


def chat(client, **kwargs):
    kwargs.setdefault("max_tokens", 300)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)


def stream_chat(client, **kwargs) -> tuple[str, dict[int, dict], str | None]:
    """(content, tool calls by index as the client accumulates them, finish_reason)."""
    kwargs.setdefault("max_tokens", 300)
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.id:
                slot["id"], slot["name"] = call.id, call.function.name
            slot["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def post(srv, route: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url_for("v1", route), json={"model": "tiny", **body}, timeout=60)


# ---------------------------------------------------------------------------------- response_format
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 1), (1.0, 2)])
def test_response_format_json_schema(client, temperature, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = chat(client, response_format=fmt, temperature=temperature, seed=seed)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_response_format_json_object_and_streaming(client):
    # Any object is allowed, so a random model may write one longer than max_tokens.
    out = chat(client, response_format={"type": "json_object"}, temperature=1.0, seed=0, n=6)
    finished = [c for c in out.choices if c.finish_reason == "stop"]
    assert finished and all(c.message.content.startswith("{") for c in out.choices)
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    content, calls, finish = stream_chat(client, response_format=fmt, temperature=1.0, seed=5)
    assert finish == "stop" and not calls
    jsonschema.validate(json.loads(content), PERSON)


# ---------------------------------------------------------------------------------- vLLM fields
def test_structured_outputs_and_guided_fields_on_completions(srv):
    cases = [
        ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ({"guided_json": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ({"guided_regex": r"[A-Z]{3}-\d{2}"}, lambda t: re.fullmatch(r"[A-Z]{3}-\d{2}", t) or 1 / 0),
        ({"structured_outputs": {"regex": r"(up|down)"}}, lambda t: t in ("up", "down") or 1 / 0),
        ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta") or 1 / 0),
        (
            {"guided_grammar": 'root ::= "(" [0-9] ("+" [0-9]){0,3} ")"'},
            lambda t: re.fullmatch(r"\(\d(\+\d){0,3}\)", t) or 1 / 0,
        ),
    ]
    for body, check in cases:
        r = post(
            srv, "completions", {"prompt": ["Answer:", "Hi"], "max_tokens": 200, "temperature": 1.0, "seed": 3, **body}
        )
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop", (body, choice)
            check(choice["text"])


# ---------------------------------------------------------------------------------- tool calls
def test_required_tool_choice(client):
    for temperature, seed in [(0.0, None), (1.0, 11), (1.0, 12)]:
        out = chat(
            client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=temperature, seed=seed
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_named_tool_choice(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(client, tools=TOOLS, tool_choice=named, temperature=1.0, seed=4)
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_calls_accumulate_like_openai(client, tool_choice):
    content, calls, finish = stream_chat(
        client, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, temperature=1.0, seed=9
    )
    assert finish == "tool_calls" and content == "" and list(calls) == [0]
    call = calls[0]
    assert call["id"].startswith("chatcmpl-tool-") and call["name"] in PARAMS
    jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])


def test_auto_tool_choice_parses_hermes_calls(client):
    # A random model never writes <tool_call> on its own: force the text format with a regex and
    # let the hermes parser find the call in it (the path a real model's output takes).
    regex = r'Checking\.\n<tool_call>\{"name": "get_time", "arguments": \{"tz": "UTC\+[1-9]"\}\}</tool_call>'
    out = chat(client, tools=TOOLS, extra_body={"structured_outputs": {"regex": regex}}, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert choice.message.tool_calls[0].function.name == "get_time"
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), PARAMS["get_time"])
    content, calls, finish = stream_chat(
        client, tools=TOOLS, extra_body={"structured_outputs": {"regex": regex}}, temperature=0
    )
    assert finish == "tool_calls" and content.strip() == "Checking." and calls[0]["name"] == "get_time"
    # No call in the text: a plain answer.
    plain = chat(client, tools=TOOLS, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_multi_turn_with_tool_results(client):
    history = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    assert out.choices[0].message.tool_calls is None


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "route, body, param, message",
    [
        (
            "chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}},
                }
            },
            "response_format",
            'response_format: invalid JSON schema: Unsupported type "strnig"',
        ),
        (
            "chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            None,
            "needs json_schema.schema",
        ),
        ("completions", {"guided_regex": "(ab"}, "guided_regex", "guided_regex: invalid regex: .*not closed"),
        (
            "completions",
            {"structured_outputs": {"grammar": "root ::= missing"}},
            "structured_outputs",
            'structured_outputs: invalid grammar: .*Rule "missing" is not defined',
        ),
        ("completions", {"guided_choice": []}, "guided_choice", "guided_choice must be a non-empty list"),
        (
            "completions",
            {"guided_json": {"type": "object"}, "guided_regex": "a"},
            "guided_regex",
            "guided_regex conflicts with guided_json",
        ),
        (
            "chat/completions",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "names the function 'nope', which is not in tools",
        ),
        (
            "chat/completions",
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/none"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "tools: invalid JSON schema",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_400s(srv, route, body, param, message, stream):
    base = {"messages": MESSAGES} if route.startswith("chat") else {"prompt": "x"}
    r = post(srv, route, {**base, "max_tokens": 5, "stream": stream, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert re.search(message, error["message"]), error
    if param is not None:
        assert error["param"] == param


def test_engine_idle_after_all(srv, client):
    out = chat(client, max_tokens=3, temperature=0)
    assert out.choices[0].message.content is not None
    assert metric(srv, "vllm:num_requests_running") == 0 and metric(srv, "vllm:num_requests_waiting") == 0
    assert metric(srv, "vllm:kv_cache_usage_perc") == 0


# ---------------------------------------------------------------------------------- engine-side failure
def test_engine_side_compile_failure_fails_only_that_request(server_model_dir):
    """With the front-end check bypassed, the engine process compiles the bad schema itself:
    that request fails with the compile error (a ValueError, a 400 on the server); others run."""

    async def main() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=str(server_model_dir), max_model_len=256))
        try:

            async def no_check(params) -> None:
                return None

            engine.check_structured_outputs = no_check
            from pagedllm.sampling_params import SamplingParams

            bad = SamplingParams(max_tokens=8, structured_outputs={"json": {"type": "strnig"}})
            good = SamplingParams(max_tokens=50, structured_outputs={"json": PERSON})

            async def run(params, request_id):
                return [o async for o in engine.generate("hi", params, request_id)][-1]

            results = await asyncio.gather(run(bad, "bad"), run(good, "good"), return_exceptions=True)
            assert isinstance(results[0], ValueError) and 'Unsupported type "strnig"' in str(results[0])
            jsonschema.validate(json.loads(results[1].outputs[0].text), PERSON)
            assert await engine.call_utility("check_integrity") is True
        finally:
            engine.shutdown()

    asyncio.run(main())
