"""Clients users point at a vLLM server, unchanged, against a real server ("tiny"):
LlamaIndex's ``OpenAILike`` and the requests Open WebUI sends for an OpenAI connection."""

from __future__ import annotations

import json
import os

import httpx
import pytest

MAX_TOKENS = 8


# ----------------------------------------------------------------------------- LlamaIndex
@pytest.fixture(scope="module")
def llama_index_llm(server):
    """``OpenAILike(is_chat_model=False)`` completes on /v1/completions; with True it chats on
    /v1/chat/completions. Both as in LlamaIndex's vLLM recipe (api_base, api_key "EMPTY")."""
    if os.environ.get("PAGEDLLM_REQUIRE_LLAMA_INDEX"):  # .ci/run's client environment: a missing package fails
        import llama_index.llms.openai_like as openai_like
    else:
        openai_like = pytest.importorskip("llama_index.llms.openai_like")

    def make(is_chat_model: bool):
        return openai_like.OpenAILike(
            model="tiny",
            api_base=f"{server.url}/v1",
            api_key="EMPTY",
            is_chat_model=is_chat_model,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            max_retries=0,
            timeout=120,
        )

    return make


def _chat_messages():
    from llama_index.core.llms import ChatMessage

    return [ChatMessage(role="system", content="You are terse."), ChatMessage(role="user", content="Say hello.")]


def test_llama_index_complete_and_stream_complete(llama_index_llm):
    llm = llama_index_llm(False)
    out = llm.complete("Hello, my name is")
    assert isinstance(out.text, str) and out.text
    assert out.raw.object == "text_completion" and out.raw.model == "tiny"
    deltas = [r.delta for r in llm.stream_complete("Hello, my name is")]
    assert len(deltas) >= 2 and "".join(d or "" for d in deltas) == out.text  # greedy: the same text


def test_llama_index_chat_and_stream_chat(llama_index_llm):
    llm = llama_index_llm(True)
    out = llm.chat(_chat_messages())
    assert out.message.role == "assistant" and out.message.content
    assert out.raw.object == "chat.completion" and out.raw.model == "tiny"
    chunks = list(llm.stream_chat(_chat_messages()))
    assert chunks and chunks[-1].message.content == out.message.content


def test_llama_index_async_chat(llama_index_llm):
    import asyncio

    out = asyncio.run(llama_index_llm(True).achat(_chat_messages()))
    assert out.message.content


# ----------------------------------------------------------------------------- Open WebUI
# Open WebUI (open-webui/open-webui, backend/open_webui/routers/openai.py): the model list is
# GET {base}/models with "Authorization: Bearer KEY"; a chat is POST {base}/chat/completions with
# the chat form minus "metadata", stream_options.include_usage forced on when streaming, and the
# model's params (temperature, max_tokens, ...) merged in. Forks and older releases let more of
# the form through: the unknown fields below must be ignored, not refused.
OPEN_WEBUI_EXTRA_FIELDS = {
    "options": {"temperature": 0.0, "num_ctx": 2048},
    "metadata": {"task": "title_generation", "chat_id": "c-1"},
    "features": {"image_generation": False, "code_interpreter": False, "web_search": False},
    "session_id": "Zx9-session",
    "chat_id": "6f1c2e8a-0000-4000-8000-000000000001",
    "id": "7a2d3f9b-0000-4000-8000-000000000002",
    "background_tasks": {"title_generation": True, "tags_generation": True, "follow_up_generation": True},
    "params": {},
    "tool_ids": None,
    "files": None,
    "variables": {"{{USER_NAME}}": "user", "{{CURRENT_DATE}}": "2025-01-01"},
    "model_item": {"id": "tiny", "object": "model", "owned_by": "openai", "urlIdx": 0},
}


def _open_webui_chat(stream: bool) -> dict:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hi there"},
        ],
        "stream": stream,
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
        **OPEN_WEBUI_EXTRA_FIELDS,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _headers() -> dict[str, str]:
    return {"Content-Type": "application/json", "Authorization": "Bearer sk-open-webui"}


def test_open_webui_lists_models(server):
    r = httpx.get(server.url_for("v1", "models"), headers=_headers(), timeout=10)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["tiny"]
    assert all(m["object"] == "model" for m in body["data"])


def test_open_webui_streamed_chat_with_usage_and_unknown_fields(server):
    events = []
    with httpx.stream(
        "POST",
        server.url_for("v1", "chat", "completions"),
        content=json.dumps(_open_webui_chat(stream=True)),  # Open WebUI posts the json.dumps'd body
        headers=_headers(),
        timeout=120,
    ) as r:
        assert r.status_code == 200, r.read()
        assert "text/event-stream" in r.headers["content-type"]  # how Open WebUI tells a stream
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny" for c in chunks)
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert text
    finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert finish == ["length"] or finish == ["stop"]
    usage_chunk = chunks[-1]  # include_usage: a last chunk with no choices and the usage
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert 1 <= usage["completion_tokens"] <= MAX_TOKENS and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_open_webui_plain_chat_with_unknown_fields(server):
    """The non-streamed shape (title / tags generation tasks) and its usage."""
    r = httpx.post(
        server.url_for("v1", "chat", "completions"),
        content=json.dumps(_open_webui_chat(stream=False)),
        headers=_headers(),
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] >= 1
