"""POST /v1/responses and GET /v1/responses/{id} against a real server, parsed by the official
client; the output builder, message conversion and response store without a server."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pagedllm.entrypoints.openai.protocol_responses import INPUT_ITEMS, to_messages
from pagedllm.entrypoints.openai.serving_responses import ResponseStore, StoredResponse, _OutputBuilder
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser

INSTRUCTIONS = "You are a helpful assistant."
QUESTION = "Tell me a story about a fox."
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
}
EVENTS: TypeAdapter = TypeAdapter(ResponseStreamEvent)


def create(client, **kw) -> Response:
    """A response whose raw JSON also validates strictly against the client's model."""
    kw.setdefault("max_output_tokens", 12)
    kw.setdefault("temperature", 0)
    raw = client.responses.with_raw_response.create(model="tiny", **kw)
    Response.model_validate(raw.http_response.json())
    return raw.parse()


def stream(client, **kw) -> list:
    kw.setdefault("max_output_tokens", 12)
    kw.setdefault("temperature", 0)
    events = list(client.responses.create(model="tiny", stream=True, **kw))
    for event in events:
        EVENTS.validate_python(event.model_dump(by_alias=True))
    return events


def num_tokens(server, messages, **kw) -> int:
    r = httpx.post(server.url_for("tokenize"), json={"model": "tiny", "messages": messages, **kw}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url_for("v1", "responses"), json={"model": "tiny", **body}, timeout=60)


# ---------------------------------------------------------------------------------- text
def test_greedy_output_equals_chat(client, server):
    out = create(client, instructions=INSTRUCTIONS, input=QUESTION, extra_body={"ignore_eos": True})
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.id.startswith("resp_") and out.object == "response" and out.model == "tiny"
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert out.output_text == message.content[0].text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens == num_tokens(server, messages)
    assert out.usage.output_tokens == 12 and out.usage.total_tokens == out.usage.input_tokens + 12
    assert out.usage.output_tokens_details.reasoning_tokens == 0
    assert out.usage.input_tokens_details.cached_tokens >= 0
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete" and out.instructions == INSTRUCTIONS


def test_item_input_with_parts_and_developer_role_equals_chat(client):
    items = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "What?"}]},
        {"role": "user", "content": "a story"},
    ]
    out = create(client, input=items, max_output_tokens=8)
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "Tell me"},
        {"role": "assistant", "content": "What?"},
        {"role": "user", "content": "a story"},
    ]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens


def test_echoed_fields(client):
    out = create(client, input="Hi", metadata={"k": "v"}, user="u1", parallel_tool_calls=False, top_p=0.5)
    assert out.metadata == {"k": "v"} and out.user == "u1" and out.parallel_tool_calls is False
    assert out.top_p == 0.5 and out.temperature == 0 and out.max_output_tokens == 12 and out.store is True
    assert out.tools == [] and out.tool_choice == "none" and out.text.format.type == "text"


def test_streaming_equals_non_streaming_and_event_order(client):
    full = create(client, input=QUESTION, max_output_tokens=16, extra_body={"ignore_eos": True})
    events = stream(client, input=QUESTION, max_output_tokens=16, extra_body={"ignore_eos": True})
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in deltas) and events[-2].item.id == item_id
    text = "".join(e.delta for e in deltas)
    assert text == full.output_text == events[-4].text == events[-3].part.text
    final = events[-1].response
    assert final.output_text == text and final.status == "incomplete"
    assert final.usage.input_tokens == full.usage.input_tokens and final.usage.output_tokens == 16
    assert events[0].response.id == final.id


def test_completed_status_when_the_model_stops(client):
    fmt = {"type": "json_schema", "name": "yes", "schema": {"type": "string", "enum": ["yes"]}}
    out = create(client, input="Hi", text={"format": fmt}, max_output_tokens=50)
    assert out.status == "completed" and out.incomplete_details is None and out.completed_at is not None
    assert out.output_text == '"yes"' and out.output[0].status == "completed"
    events = stream(client, input="Hi", text={"format": fmt}, max_output_tokens=50)
    assert events[-1].type == "response.completed" and events[-2].item.status == "completed"
    assert events[-1].response.output_text == '"yes"'


# ---------------------------------------------------------------------------------- tools
def test_forced_function_call_round_trip(client, server):
    named = {"type": "function", "name": "get_weather"}
    out = create(client, input="Weather in Paris?", tools=TOOLS, tool_choice=named, max_output_tokens=300)
    assert out.status == "completed" and out.tool_choice.name == "get_weather"
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow_up = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    answer = create(client, input=follow_up, tools=TOOLS, tool_choice="none", max_output_tokens=4)
    assert answer.output[0].type == "message"
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    assert answer.usage.input_tokens == num_tokens(server, messages)


def test_required_function_call_streams_arguments(client):
    kw = dict(input="Weather?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=300)
    full = create(client, **kw)
    events = stream(client, **kw)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == events[-3].arguments == full.output[0].arguments
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert events[-1].response.output[0].call_id == events[2].item.call_id


def test_auto_tool_choice_needs_a_parser(server):
    r = post(server, {"input": "Hi", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in r.json()["error"]["message"]


def test_hermes_calls_and_text_become_items():
    builder = _OutputBuilder(HermesToolParser())
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>'
    events = builder.feed(text[:10], finished=False) + builder.feed(text[10:], finished=True)
    events += builder.close("completed")
    message, call = builder.items
    assert message["content"][0]["text"].strip() == "Sure." and message["status"] == "completed"
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Lima"}
    kinds = [e["type"] for e in events]
    assert kinds[kinds.index("response.output_item.done") :] == [
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]


# ---------------------------------------------------------------------------------- structured output
def test_json_schema_format(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    out = create(client, input="Who?", text={"format": fmt}, max_output_tokens=300)
    assert out.status == "completed" and out.text.format.name == "person"
    jsonschema.validate(json.loads(out.output_text), PERSON)
    events = stream(client, input="Who?", text={"format": fmt}, max_output_tokens=300)
    assert events[-1].response.output_text == out.output_text


def test_json_object_format(client):
    out = create(client, input="JSON please", text={"format": {"type": "json_object"}}, max_output_tokens=300)
    if out.status == "completed":  # any object is allowed: a random model may write a long one
        assert isinstance(json.loads(out.output_text), dict)


# ---------------------------------------------------------------------------------- conversation state
def test_previous_response_id_continues_and_retrieve(client, server):
    first = create(client, instructions=INSTRUCTIONS, input="Hi", max_output_tokens=5, extra_body={"ignore_eos": True})
    second = create(client, input="More", previous_response_id=first.id, max_output_tokens=3)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "More"},
    ]  # the first turn's instructions are not carried over (as OpenAI)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == num_tokens(server, messages)
    third = create(client, input="Again", previous_response_id=second.id, max_output_tokens=3)
    messages += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Again"}]
    assert third.usage.input_tokens == num_tokens(server, messages)
    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()


def test_streamed_responses_are_stored(client):
    events = stream(client, input="Hi", max_output_tokens=3)
    final = events[-1].response
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_store_false_is_not_kept(client):
    out = create(client, input="Hi", store=False, max_output_tokens=2)
    assert out.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError) as info:
        create(client, input="More", previous_response_id=out.id)
    assert info.value.body["param"] == "previous_response_id"


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"input": ""}, "input", "must not be empty"),
        ({"input": []}, "input", "must not be empty"),
        ({}, "input", "Field required"),
        ({"input": 5}, "input", "invalid value"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "'reasoning' are not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "robot"),
        ({"input": "x", "temperature": "hot"}, "temperature", "valid number"),
        ({"input": "x", "temperature": -1}, "temperature", "temperature"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_tokens"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "no reasoning parser"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "'web_search' are not supported"),
        (
            {"input": "x", "tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "required"},
            "tools.0",
            "bad name!",
        ),
        ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
        ({"input": "x", "background": True}, "background", "background"),
        ({"input": "x", "background": "true"}, "background", "background"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "include"),
        ({"input": "x", "truncation": "auto"}, "truncation", "truncation"),
        ({"input": "x", "top_logprobs": 3}, "top_logprobs", "top_logprobs"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "conversation"),
        ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format", "needs name"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strnig"}}}},
            "text.format",
            "invalid JSON schema",
        ),
        ({"input": "x", "metadata": {"k": "v" * 600}}, "metadata", "512"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, body, param, message):
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"] == param or error["param"].startswith(f"{param}.")) and message in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_over_long_input_and_output(server, stream):
    r = post(server, {"input": "fox " * 600, "stream": stream})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "max_model_len" in r.json()["error"]["message"] and "512" in r.json()["error"]["message"]
    r = post(server, {"input": "fox", "max_output_tokens": 10_000, "stream": stream})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


def test_unknown_ids(server):
    r = post(server, {"input": "x", "previous_response_id": "resp_missing"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.get(server.url_for("v1", "responses", "resp_missing"), timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = post(server, {"input": "x", "model": "other"})
    assert r.status_code == 404


def test_accepted_fields_without_effect(client):
    out = create(
        client,
        input="Hi",
        max_output_tokens=2,
        reasoning={"effort": "none"},
        truncation="disabled",
        include=[],
        service_tier="auto",
        safety_identifier="s",
        prompt_cache_key="k",
    )
    assert out.output_text is not None


# ---------------------------------------------------------------------------------- without a server
def test_function_calls_join_the_assistant_turn():
    items = INPUT_ITEMS.validate_python(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c2", "output": "2"},
        ]
    )
    user, assistant, tool = to_messages(items)
    assert assistant.text == "let me see" and [c.function.name for c in assistant.tool_calls] == ["f", "g"]
    assert tool.role == "tool" and tool.tool_call_id == "c2" and tool.name == "g" and tool.text == "2"


def test_store_evicts_least_recently_used():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is not None
    store.put("c", StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
