"""POST /v1/chat/completions against a real server, with the official client and httpx."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me a story about a fox."},
]


def num_prompt_tokens(tokenizer, messages) -> int:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat(client, messages=MESSAGES, **kw) -> ChatCompletion:
    """A chat completion whose raw JSON also validates strictly against the client's model."""
    kw.setdefault("max_tokens", 12)
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, **kw)
    ChatCompletion.model_validate(raw.http_response.json())
    return raw.parse()


def stream_chat(client, messages=MESSAGES, **kw) -> list[ChatCompletionChunk]:
    kw.setdefault("max_tokens", 12)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True, **kw))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
    return chunks


def test_chat_shape_and_exact_usage(client, tokenizer):
    out = chat(client, temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == "tiny"
    choice = out.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == num_prompt_tokens(tokenizer, MESSAGES)
    assert out.usage.completion_tokens == len(choice.logprobs.content) == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_model_may_be_omitted_and_content_parts(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}]}]
    r = httpx.post(
        server.url_for("v1", "chat", "completions"),
        timeout=30,
        json={"messages": parts, "max_tokens": 3, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny"


def test_streaming_matches_non_streaming(client):
    full = chat(client, temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    chunks = stream_chat(
        client, temperature=0, max_tokens=16, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n2_seeded_sampling_is_reproducible(client):
    kw = dict(temperature=1.0, n=2, seed=7, max_tokens=10)
    first, second = chat(client, **kw), chat(client, **kw)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in stream_chat(client, **kw):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [texts[0], texts[1]] == [c.message.content for c in first.choices]
    assert sorted(finishes) == [0, 1]


def test_stop_string(client):
    text = chat(client, temperature=0, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"pick a different prompt: {text!r}"
    out = chat(client, temperature=0, max_tokens=24, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_logprobs_shape(client):
    out = chat(client, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
    chunks = stream_chat(
        client, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    plain = chat(client, temperature=0, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_cached_tokens_on_repeated_long_prompt(client, tokenizer):
    messages = [{"role": "user", "content": " ".join(f"fact{i}" for i in range(50))}]
    num_tokens = num_prompt_tokens(tokenizer, messages)
    assert num_tokens >= 200
    first = chat(client, messages, max_tokens=2, temperature=0)
    second = chat(client, messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == num_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= (num_tokens // 16 - 1) * 16 > 0


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2)
    assert info.value.body["message"] == "The model `gpt-4` does not exist; this server serves `tiny`."
    assert info.value.body["param"] == "model"


BAD = [
    ({"messages": []}, "messages", "at least one"),
    ({"messages": "hi"}, "messages", "messages"),
    ({"messages": [{"role": "", "content": "hi"}]}, "messages.0.role", "role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages.0.content.0",
        "text",
    ),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"top_p": 1.5}, "top_p", "top_p"),
    ({"top_k": -5}, "top_k", "top_k"),
    ({"min_p": 2}, "min_p", "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
    ({"frequency_penalty": 9}, "frequency_penalty", "frequency_penalty"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", "20"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"max_tokens": 10_000}, "max_tokens", "512"),
    ({"max_completion_tokens": 10_000}, "max_completion_tokens", "512"),
    ({"max_tokens": -1}, "max_tokens", "max_tokens"),
    ({"min_tokens": 20, "max_tokens": 4}, "min_tokens", "min_tokens"),
    ({"n": "two"}, "n", "n"),
    ({"n": 1000}, "n", "n"),
    ({"seed": "abc"}, "seed", "seed"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias"),
    ({"stream": "perhaps"}, "stream", "stream"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs", "tokenize"),
]


@pytest.mark.parametrize("change,param,needle", BAD, ids=[str(b[0])[:60] for b in BAD])
def test_bad_input_is_400(server, change, param, needle):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **change}
    r = httpx.post(server.url_for("v1", "chat", "completions"), json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert error["type"] == "BadRequestError" and error["code"] == 400


def test_bad_input_through_the_client(client, tokenizer):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=-1)
    assert info.value.body["param"] == "temperature"
    long_messages = [{"role": "user", "content": "word " * 600}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=long_messages)
    message = info.value.body["message"]
    assert "512" in message and str(num_prompt_tokens(tokenizer, long_messages)) in message


def test_streaming_request_errors_before_the_stream_starts(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10_000, stream=True)
    assert info.value.body["param"] == "max_tokens" and "512" in info.value.body["message"]


def test_tokenize_counts_what_chat_sends(server, client):
    kwargs = {"chat_template_kwargs": {"unused_flag": True}, "add_generation_prompt": True}
    tok = httpx.post(server.url_for("tokenize"), json={"model": "tiny", "messages": MESSAGES, **kwargs}, timeout=30)
    assert tok.status_code == 200, tok.text
    out = chat(client, max_tokens=1, extra_body=kwargs)
    assert out.usage.prompt_tokens == tok.json()["count"]
