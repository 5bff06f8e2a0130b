"""``use_beam_search`` on /v1/completions and /v1/chat/completions (width ``n``), against a real
server with the official client: the choices are the offline ``LLM.beam_search`` results on the
same model, fields a beam search cannot honour are 400s, and no request is left behind."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from pagedllm import LLM
from pagedllm.beam_search import BeamSearchParams

PROMPT = "The quick brown fox jumps over the lazy dog and then"
MESSAGES = [{"role": "user", "content": "Tell me a story about a fox."}]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def offline(server_model_dir):
    """The server's defaults (max_model_len, dtype, max_logprobs) offline."""
    return LLM(str(server_model_dir))


def offline_beams(offline, prompt, width: int) -> list:
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, temperature=0.0)
    return offline.beam_search([prompt], params)[0].sequences


@pytest.mark.parametrize("n", [2, 3])
def test_completion_beams_equal_offline(client, offline, tokenizer, n):
    resp = client.completions.create(
        model="tiny", prompt=PROMPT, n=n, max_tokens=MAX_TOKENS, temperature=0, extra_body={"use_beam_search": True}
    )
    beams = offline_beams(offline, PROMPT, n)
    assert [c.text for c in resp.choices] == [b.text for b in beams]
    assert [c.index for c in resp.choices] == list(range(n))
    assert [c.finish_reason for c in resp.choices] == [b.finish_reason for b in beams]
    prompt_len = len(tokenizer.encode(PROMPT))
    assert resp.usage.prompt_tokens == prompt_len
    assert resp.usage.completion_tokens == sum(len(b.output_token_ids) for b in beams)


@pytest.mark.parametrize("n", [2, 3])
def test_chat_beams_equal_offline(client, server, offline, n):
    resp = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        n=n,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"use_beam_search": True},
    )
    tokenized = httpx.post(server.url_for("tokenize"), json={"model": "tiny", "messages": MESSAGES}, timeout=60)
    prompt_ids = tokenized.json()["tokens"]  # the chat route's rendering
    beams = offline_beams(offline, {"prompt_token_ids": prompt_ids}, n)
    assert [c.message.content for c in resp.choices] == [b.text for b in beams]
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == sum(len(b.output_token_ids) for b in beams)


def test_length_penalty_reaches_the_search(client, offline):
    resp = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        n=3,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"use_beam_search": True, "length_penalty": 0.0},
    )
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, length_penalty=0.0)
    beams = offline.beam_search([PROMPT], params)[0].sequences
    assert [c.text for c in resp.choices] == [b.text for b in beams]


def test_stream_sends_the_final_beams_then_done(server, client):
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "n": 2,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "use_beam_search": True,
        "stream": True,
    }
    with httpx.stream("POST", server.url_for("v1", "completions"), json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln[len("data: ") :] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(ln) for ln in lines[:-1]]
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1]
    plain = client.completions.create(
        model="tiny", prompt=PROMPT, n=2, max_tokens=MAX_TOKENS, temperature=0, extra_body={"use_beam_search": True}
    )
    assert [c["choices"][0]["text"] for c in chunks] == [c.text for c in plain.choices]
    assert all(c["choices"][0]["finish_reason"] for c in chunks)


def test_width_over_the_logprobs_cap_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:  # the default cap: 20 logprobs, width 10
        client.completions.create(model="tiny", prompt=PROMPT, n=11, extra_body={"use_beam_search": True})
    assert info.value.body["param"] == "n" and "max_logprobs" in info.value.body["message"]


def test_logprobs_with_beam_search_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, n=2, logprobs=1, extra_body={"use_beam_search": True})
    assert info.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, n=2, logprobs=True, extra_body={"use_beam_search": True}
        )
    assert info.value.body["param"] == "logprobs"


def test_stop_and_structured_output_with_beam_search_are_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, n=2, stop=["x"], extra_body={"use_beam_search": True})
    assert info.value.body["param"] == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            n=2,
            extra_body={"use_beam_search": True, "structured_outputs": {"regex": "a+"}},
        )
    assert info.value.body["param"] == "structured_outputs"


def test_too_long_prompt_is_400(client, server):
    resp = httpx.post(
        server.url_for("v1", "completions"),
        json={"model": "tiny", "prompt": [1] * 100_000, "use_beam_search": True, "n": 2, "stream": True},
        timeout=60,
    )
    assert resp.status_code == 400 and "max_model_len" in resp.json()["error"]["message"]


def metric(server, name: str) -> float:
    text = httpx.get(server.url_for("metrics")).text
    return float(next(ln for ln in text.splitlines() if ln.startswith(f"vllm:{name}")).split()[-1])


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_the_search(server, client, stream):
    """A search to the context limit, abandoned after a moment: its step requests are aborted
    (a short request afterwards finds the cache empty and nothing else running)."""
    body = {"model": "tiny", "messages": MESSAGES, "n": 4, "use_beam_search": True, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url_for("v1", "chat", "completions"), json={**body, "stream": stream}, timeout=1.0)
    time.sleep(0.5)  # about one disconnect poll, and the abort's trip to the engine
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert metric(server, "kv_cache_usage_perc") == 0.0
    assert metric(server, "num_requests_running") == 0.0


def test_no_blocks_left_in_use(server):
    """Every search above finished or was refused: the KV cache is empty again."""
    text = httpx.get(server.url_for("metrics")).text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:kv_cache_usage_perc"))
    assert float(line.split()[-1]) == 0.0
