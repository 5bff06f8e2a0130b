"""Tool calls without a server: the forcing schemas, and extracting calls from model text (whole
and streamed in arbitrary pieces) for forced choices and the hermes / llama3_json parsers."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from pagedllm.entrypoints.openai.errors import RequestParamError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_calls import NamedToolCall, RequiredToolCalls, tool_choice_schema
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city"],
    "$defs": {"unit": {"enum": ["c", "f"]}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping"}},
]


def request(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kwargs})


def streamed(extractor, text: str, seed: int = 0) -> tuple[str, list[dict]]:
    """Feed ``text`` in random pieces; return (content, calls) as an OpenAI client accumulates them."""
    rng = random.Random(seed)
    deltas, pos = [], 0
    while pos < len(text):
        size = rng.randint(1, 6)
        deltas += extractor.feed(text[pos : pos + size])
        pos += size
    deltas += extractor.finish()
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            slot = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in call:
                slot.update(id=call["id"], name=call["function"]["name"])
            slot["arguments"] += call["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def as_pairs(calls: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        function = call.get("function", call)
        out.append((function["name"], json.loads(function["arguments"])))
    return out


# ------------------------------------------------------------------ schemas
def test_required_schema_accepts_calls_of_any_tool_and_hoists_defs():
    schema = tool_choice_schema(request(tools=TOOLS).tools, "required", parallel=True)
    assert schema["$defs"] == {"unit": {"enum": ["c", "f"]}}
    good = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"unit": "c"}}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather", "parameters": {"city": "x", "unit": "k"}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert tool_choice_schema(request(tools=TOOLS).tools, "required", parallel=False)["maxItems"] == 1


def test_named_choice_schema_is_the_functions_parameters():
    req = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    structured, param = req.constraint()
    assert param == "tools" and json.loads(structured.key()[1]) == WEATHER
    ping = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}}).constraint()[0]
    assert json.loads(ping.key()[1]) == {"type": "object", "properties": {}}
    assert request(tools=TOOLS, tool_choice="auto").constraint() == (None, None)
    assert request(tools=TOOLS, tool_choice="none").constraint() == (None, None)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "names the function 'nope', which is not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "already constrains the output; drop response_format",
        ),
    ],
)
def test_bad_tool_choices(kwargs, message):
    with pytest.raises(RequestParamError, match=message):
        request(**kwargs).constraint()


def test_conflicting_defs_are_rejected():
    other = {
        "type": "function",
        "function": {
            "name": "other",
            "parameters": {
                "type": "object",
                "properties": {"u": {"$ref": "#/$defs/unit"}},
                "$defs": {"unit": {"enum": ["k"]}},
            },
        },
    }
    with pytest.raises(RequestParamError, match=r"different schemas under \$defs/unit"):
        request(tools=[*TOOLS, other], tool_choice="required").constraint()


# ------------------------------------------------------------------ forced calls
def test_required_calls_whole_and_streamed():
    text = json.dumps(
        [{"name": "get_weather", "parameters": {"city": 'Pa"ris}{', "unit": "c"}}, {"name": "ping", "parameters": {}}]
    )
    content, calls = RequiredToolCalls().extract(text)
    assert content is None and as_pairs(calls) == [("get_weather", {"city": 'Pa"ris}{', "unit": "c"}), ("ping", {})]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    for seed in range(20):
        streamed_content, streamed_calls = streamed(RequiredToolCalls(), text, seed)
        assert streamed_content == "" and as_pairs(streamed_calls) == as_pairs(calls)
    assert RequiredToolCalls().extract(text[:-5]) == (text[:-5], [])  # cut off: no calls


def test_named_call_streams_argument_deltas():
    arguments = '{"city": "Tokyo"}'
    content, calls = streamed(NamedToolCall("get_weather"), arguments)
    assert content == "" and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == arguments
    assert NamedToolCall("x").extract(arguments)[1][0]["function"] == {"name": "x", "arguments": arguments}


# ------------------------------------------------------------------ auto: parsers
HERMES_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
)


def test_hermes_parser():
    content, calls = HermesToolParser().extract(HERMES_TEXT)
    assert content == "Let me check." and as_pairs(calls) == [("get_weather", {"city": "Paris"}), ("ping", {})]
    for seed in range(20):
        streamed_content, streamed_calls = streamed(HermesToolParser(), HERMES_TEXT, seed)
        assert streamed_content.strip() == "Let me check." and as_pairs(streamed_calls) == as_pairs(calls)
    plain = "No tools needed; 3 < 4 and <tool is not a tag."
    assert HermesToolParser().extract(plain) == (plain, [])
    assert streamed(HermesToolParser(), plain) == (plain, [])
    broken = "<tool_call>{not json}</tool_call>"
    assert HermesToolParser().extract(broken) == (broken, [])
    assert streamed(HermesToolParser(), broken) == (broken, [])
    unclosed = '<tool_call>{"name": "ping", "arguments": {}}'  # cut before the end tag
    assert as_pairs(HermesToolParser().extract(unclosed)[1]) == [("ping", {})]
    assert as_pairs(streamed(HermesToolParser(), unclosed)[1]) == [("ping", {})]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Lima"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}',
        ' {"name": "get_weather", "arguments": {"city": "Lima"}}; {"name": "ping", "parameters": {}}',
    ],
)
def test_llama3_json_parser(text):
    content, calls = Llama3JsonToolParser().extract(text)
    assert content is None and as_pairs(calls)[0] == ("get_weather", {"city": "Lima"})
    streamed_content, streamed_calls = streamed(Llama3JsonToolParser(), text)
    assert streamed_content == "" and as_pairs(streamed_calls) == as_pairs(calls)


def test_llama3_json_parser_leaves_prose_alone():
    for text in ["The weather is fine.", '{"not": "a call"}', "<b>bold</b>"]:
        assert Llama3JsonToolParser().extract(text) == (text, [])
        assert streamed(Llama3JsonToolParser(), text) == (text, [])


def test_auto_needs_a_parser_on_the_server():
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

    handler = OpenAIServingChat(None, ["tiny"])  # no --enable-auto-tool-choice
    for kwargs in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        with pytest.raises(RequestParamError, match="--enable-auto-tool-choice --tool-call-parser"):
            handler.check_auto_tools(request(**kwargs))
    for choice in ("none", "required"):
        handler.check_auto_tools(request(tools=TOOLS, tool_choice=choice))
