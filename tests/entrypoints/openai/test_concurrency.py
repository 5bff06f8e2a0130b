"""Many clients at once, and clients that hang up: a real server, checked through /metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

NUM_CONCURRENT = 64
MAX_MODEL_LEN = 4096  # long enough that a hung-up request could not finish while the clients hang up
LONG_MAX_TOKENS = 4000
WITNESS_MAX_TOKENS = 4080


@pytest.fixture(scope="module")
def server_model_dir(tiny_model_dir):
    """The tiny llama with a longer context (this module's server serves it as "tiny")."""
    return tiny_model_dir("llama", max_position_embeddings=MAX_MODEL_LEN)


def prompts(n: int) -> list[str]:
    subjects = ["fox", "river", "city", "robot", "garden", "ship", "storm", "library"]
    return [f"Request {i}: a short story about the {subjects[i % len(subjects)]} number {i * 7}" for i in range(n)]


def metric(server, name: str) -> float:
    text = httpx.get(server.url_for("metrics"), timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} is not in /metrics")


# ---------------------------------------------------------------------------------- concurrency
async def _stream_text(client, prompt: str) -> tuple[str, str | None]:
    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True)
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


async def _all_at_once(server, texts: list[str]) -> list[tuple[str, str | None]]:
    client = server.async_openai_client()
    try:
        return await asyncio.gather(*(_stream_text(client, p) for p in texts))
    finally:
        await client.close()


def test_64_concurrent_streams_match_running_alone(server):
    texts = prompts(NUM_CONCURRENT)
    client = server.openai_client()
    alone = [
        client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text for p in texts
    ]
    together = asyncio.run(_all_at_once(server, texts))
    assert [text for text, _ in together] == alone
    assert all(finish in ("stop", "length") for _, finish in together)


# ---------------------------------------------------------------------------------- disconnects
# Proof that hung-up requests are aborted, not left to finish: a witness request streams alongside
# them. The engine steps every running request together, one token each, so none of the others
# can finish on its own before the witness has generated LONG_MAX_TOKENS more tokens than it had
# when they were sent. Seeing the running count drop to 1 (the witness) before then means aborted.


async def _metric(client: httpx.AsyncClient, server, name: str) -> float:
    text = (await client.get(server.url_for("metrics"))).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} is not in /metrics")


async def _witness(server, progress: list[int]) -> None:
    body = {"model": "tiny", "prompt": "witness", "max_tokens": WITNESS_MAX_TOKENS, "ignore_eos": True, "stream": True}
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("POST", server.url_for("v1", "completions"), json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                progress[0] += 1  # one event per step: the witness has n=1


async def _stream_then_hang_up(server, path: str, body: dict, lines: int) -> None:
    """Read ``lines`` SSE events, then close the connection mid-stream."""
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", server.url_for(*path.split("/")), json=body) as response,
    ):
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen == lines:
                break


async def _post_until_timeout(server, body: dict, timeout: float) -> None:
    async with httpx.AsyncClient(timeout=timeout) as client:
        try:
            await client.post(server.url_for("v1", "chat", "completions"), json=body)
        except httpx.TimeoutException:
            return
    raise AssertionError("the request finished before the client gave up on it")


async def _hang_up_on_everything(server) -> None:
    """Streams of 3 sequences each, closed after a few events, and one n=4 request the client
    gives up waiting for: 16 sequences that would each run LONG_MAX_TOKENS steps."""
    long = {"max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "temperature": 0.8, "model": "tiny"}
    chat = {**long, "messages": [{"role": "user", "content": "hi"}]}
    non_streaming = asyncio.ensure_future(_post_until_timeout(server, {**chat, "n": 4}, timeout=0.2))
    streams = [
        _stream_then_hang_up(server, "v1/completions", {**long, "prompt": f"story {i}", "n": 3, "stream": True}, 4)
        for i in range(2)
    ]
    streams += [
        _stream_then_hang_up(server, "v1/chat/completions", {**chat, "n": 3, "stream": True}, 4) for _ in range(2)
    ]
    await asyncio.gather(*streams)
    await non_streaming


async def _aborted_before_they_could_finish(server) -> tuple[int, int]:
    """The witness's token counts when the long requests were sent and once they were gone."""
    progress = [0]
    witness = asyncio.ensure_future(_witness(server, progress))
    try:
        while progress[0] == 0:
            await asyncio.sleep(0.01)
        sent_at = progress[0]
        await _hang_up_on_everything(server)
        async with httpx.AsyncClient(timeout=10) as client:
            while await _metric(client, server, "vllm:num_requests_running") != 1:
                assert not witness.done(), "the witness finished before the hung-up requests were gone"
                await asyncio.sleep(0.02)
        return sent_at, progress[0]
    finally:
        witness.cancel()


def _nudge(server) -> None:
    """Run one tiny request. The engine core reports its gauges with each step's outputs, so an
    abort that leaves it idle is not reflected in /metrics until the next step."""
    r = httpx.post(
        server.url_for("v1", "completions"), timeout=30, json={"model": "tiny", "prompt": "x", "max_tokens": 1}
    )
    assert r.status_code == 200


def test_disconnected_clients_free_their_blocks(server):
    _nudge(server)
    assert metric(server, "vllm:num_requests_running") == 0
    idle_usage = metric(server, "vllm:kv_cache_usage_perc")
    sent_at, gone_at = asyncio.run(_aborted_before_they_could_finish(server))
    assert gone_at < sent_at + LONG_MAX_TOKENS - 20  # a margin for the witness's own stream lag
    deadline = time.monotonic() + 10
    while True:  # the witness is gone too now: back to idle
        _nudge(server)
        running = metric(server, "vllm:num_requests_running")
        usage = metric(server, "vllm:kv_cache_usage_perc")
        if running == 0 and usage == idle_usage:
            break
        assert time.monotonic() < deadline, f"still {running} running, KV usage {usage} (idle: {idle_usage})"
        time.sleep(0.1)
    assert metric(server, "vllm:num_requests_waiting") == 0
