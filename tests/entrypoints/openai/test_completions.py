"""POST /v1/completions against a real server, with the official client and httpx."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types import Completion

PROMPT = "The quick brown fox jumps over the lazy dog and then"


def create(client, **kw) -> Completion:
    """A completion whose raw JSON also validates strictly against the client's model. (Not with
    echo + logprobs: the first prompt token's logprob is null there, as OpenAI sends it, which
    the SDK's type does not allow for but parses.)"""
    raw = client.completions.with_raw_response.create(model="tiny", **kw)
    if not (kw.get("echo") and kw.get("logprobs") is not None):
        Completion.model_validate(raw.http_response.json())
    return raw.parse()


def greedy(client, prompt=PROMPT, max_tokens=12, **kw) -> Completion:
    return create(client, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


def test_completion_shape_and_exact_usage(client, tokenizer):
    out = greedy(client, logprobs=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == "tiny"
    assert isinstance(out.created, int) and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0 and choice.finish_reason in ("stop", "length") and choice.text
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == len(choice.logprobs.tokens) <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_streaming_matches_non_streaming(client):
    full = greedy(client, max_tokens=16, extra_body={"ignore_eos": True})
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n2_and_seeds_reproducible(client):
    kw = dict(prompt=PROMPT, max_tokens=10, temperature=1.0, n=2, seed=1234)
    first, second = create(client, **kw), create(client, **kw)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == second.usage.completion_tokens
    stream = client.completions.create(model="tiny", stream=True, **kw)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [c.text for c in first.choices]


def test_stop_string(client):
    text = greedy(client, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"pick a different prompt: {text!r}"
    out = greedy(client, max_tokens=24, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == text[: text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    kept = greedy(client, max_tokens=24, stop=stop, extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


def test_logprobs_shape(client):
    out = greedy(client, max_tokens=6, logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 2 <= len(top) <= 3 and top[token] == logprob
        assert max(top.values()) == logprob  # greedy: the sampled token is the most likely
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo(client):
    out = greedy(client, max_tokens=4)
    echoed = greedy(client, max_tokens=4, echo=True)
    assert echoed.choices[0].text == PROMPT + out.choices[0].text
    with_lp = greedy(client, max_tokens=4, echo=True, logprobs=1)
    lp = with_lp.choices[0].logprobs
    assert len(lp.tokens) == with_lp.usage.prompt_tokens + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream) == echoed.choices[0].text


def test_token_id_prompt_and_list_of_prompts(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_text = greedy(client, max_tokens=8)
    by_ids = greedy(client, prompt=ids, max_tokens=8)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    other = "Once upon a time"
    out = create(client, prompt=[PROMPT, other], max_tokens=8, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    alone = greedy(client, prompt=other, max_tokens=8)
    assert [c.text for c in out.choices] == [by_text.choices[0].text] * 2 + [alone.choices[0].text] * 2
    assert out.usage.prompt_tokens == len(ids) + len(tokenizer.encode(other))
    assert out.usage.completion_tokens == 2 * (by_text.usage.completion_tokens + alone.usage.completion_tokens)
    batch = greedy(client, prompt=[ids, tokenizer.encode(other)], max_tokens=8)
    assert [c.text for c in batch.choices] == [by_text.choices[0].text, alone.choices[0].text]


def test_cached_tokens_on_repeated_long_prompt(client, tokenizer):
    prompt = " ".join(f"item{i}" for i in range(42))
    num_tokens = len(tokenizer.encode(prompt))
    assert num_tokens >= 200
    first = greedy(client, prompt=prompt, max_tokens=2)
    second = greedy(client, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == num_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= (num_tokens // 16 - 1) * 16 > 0  # full blocks


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert info.value.body["message"] == "The model `gpt-4` does not exist; this server serves `tiny`."


BAD = [
    ({"temperature": -1}, "temperature", "temperature"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"top_p": 0}, "top_p", "top_p"),
    ({"n": 0}, "n", "n"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens", "max_tokens"),
    ({"max_tokens": 10_000}, "max_tokens", "512"),
    ({"logprobs": 50}, "logprobs", "logprobs"),
    ({"suffix": "tail"}, "suffix", "suffix"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "logit_bias"),
    ({"stop": [1, 2]}, "stop", "stop"),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty"),
    ({"stop_token_ids": [99999]}, "stop_token_ids", "stop_token_ids"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": []}, "prompt", "prompt"),
    ({"prompt": [1, "a"]}, "prompt", "prompt"),
    ({"prompt": None}, "prompt", "prompt"),
]


@pytest.mark.parametrize("change,param,needle", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_input_is_400(server, change, param, needle):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **change}
    r = httpx.post(server.url_for("v1", "completions"), json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert error["type"] == "BadRequestError" and error["code"] == 400


def test_prompt_too_long_names_both_numbers(server, tokenizer):
    prompt = "word " * 700
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
    r = httpx.post(server.url_for("v1", "completions"), json=body, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "prompt"
    assert "512" in error["message"] and str(len(tokenizer.encode(prompt))) in error["message"], error


def test_streaming_request_errors_before_the_stream_starts(client):
    for kw in ({"max_tokens": 10_000}, {"prompt": "word " * 700}, {"prompt": ["ok", "word " * 700]}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**{"model": "tiny", "prompt": "hi", "stream": True, **kw})
        assert "512" in info.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "path, body",
    [
        (("v1", "completions"), {"prompt": "hi"}),
        (("v1", "chat", "completions"), {"messages": [{"role": "user", "content": "hi"}]}),
    ],
    ids=["completions", "chat"],
)
def test_priority_under_fcfs_is_400_naming_the_flag(server, path, body, stream):
    """As offline (a ValueError), a priority the fcfs scheduler would ignore is refused, not dropped."""
    r = httpx.post(
        server.url_for(*path),
        json={"model": "tiny", "max_tokens": 2, "priority": 1, "stream": stream, **body},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"], error
    ok = httpx.post(server.url_for(*path), json={"model": "tiny", "max_tokens": 2, "priority": 0, **body}, timeout=30)
    assert ok.status_code == 200, ok.text
