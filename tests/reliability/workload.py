"""A mixed workload for a live server: plain and streamed completions and chats, n > 1, structured
output, long prompts, clients that disconnect mid-stream or give up on a plain request, and bad
inputs interleaved (invalid values, wrong types, unknown model, malformed JSON, oversize prompt
and body). Each request is one ``Job``; ``run_jobs`` sends them at a fixed concurrency and
returns one ``Outcome`` per job."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "tiny"
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hex",
    "every",
    "bold",
    "jovial",
    "man",
]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@dataclass
class Job:
    kind: str
    path: str
    body: Any  # a dict (sent as JSON) or raw bytes
    stream: bool = False
    disconnect_after: int | None = None  # streamed chunks read before the client hangs up
    give_up_after_s: float | None = None  # a plain request the client abandons after this long
    expect_error: bool = False  # a bad input: a 4xx is the right answer


@dataclass
class Outcome:
    job: Job
    status: int | None = None  # None: the client hung up or gave up before an answer
    body: Any = None  # parsed JSON (plain) or the list of parsed SSE events (streamed)
    problems: list[str] = field(default_factory=list)


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _chat(rng: random.Random, **kw: Any) -> dict:
    messages = [{"role": "user", "content": _text(rng, rng.randint(3, 30))}]
    return {"model": MODEL, "messages": messages, "max_tokens": rng.randint(1, 8), **kw}


def _completion(rng: random.Random, **kw: Any) -> dict:
    return {"model": MODEL, "prompt": _text(rng, rng.randint(1, 40)), "max_tokens": rng.randint(1, 8), **kw}


GOOD: dict[str, Callable[[random.Random], Job]] = {
    "completion": lambda r: Job("completion", "/v1/completions", _completion(r, temperature=r.choice([0, 0.8]))),
    "completion_stream": lambda r: Job("completion_stream", "/v1/completions", _completion(r, stream=True), True),
    "chat": lambda r: Job("chat", "/v1/chat/completions", _chat(r, n=r.randint(1, 3), temperature=1.0)),
    "chat_stream": lambda r: Job("chat_stream", "/v1/chat/completions", _chat(r, stream=True, n=r.randint(1, 2)), True),
    "structured": lambda r: Job(
        "structured",
        "/v1/chat/completions",
        _chat(
            r, max_tokens=24, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
        ),
    ),
    "long_prompt": lambda r: Job("long_prompt", "/v1/completions", _completion(r, prompt=_text(r, 140), max_tokens=4)),
    "disconnect": lambda r: Job(
        "disconnect", "/v1/completions", _completion(r, max_tokens=32, stream=True), True, r.randint(0, 3)
    ),
    "give_up": lambda r: Job("give_up", "/v1/chat/completions", _chat(r, max_tokens=32), give_up_after_s=0.05),
}

BAD_BODIES: list[tuple[str, Any]] = [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}),
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
    ("/v1/completions", {"model": MODEL, "prompt": " ".join(WORDS * 60)}),  # longer than max_model_len
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], "mixed"]}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 10_000}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "min_tokens": 600}),  # past the room max_model_len leaves
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": 5}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 7}),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
        },
    ),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": '),  # malformed JSON
    ("/v1/completions", b'{"model": "tiny", "prompt": "' + b"a" * (300 * 1024) + b'"}'),  # over the body limit
    ("/v1/embeddings", {"model": MODEL, "input": "a generate server has no embeddings"}),
    ("/tokenize", {"prompt": 12}),
]


def make_jobs(count: int, seed: int = 0, bad_share: float = 0.2) -> list[Job]:
    """``count`` jobs: about ``bad_share`` bad inputs, the rest drawn evenly from ``GOOD``."""
    rng = random.Random(seed)
    jobs: list[Job] = []
    for _ in range(count):
        if rng.random() < bad_share:  # the bad inputs in turn, so each is sent
            path, body = BAD_BODIES[sum(j.expect_error for j in jobs) % len(BAD_BODIES)]
            jobs.append(Job("bad", path, body, expect_error=True))
        else:
            jobs.append(GOOD[rng.choice(sorted(GOOD))](rng))
    return jobs


async def run_jobs(url: str, jobs: list[Job], concurrency: int) -> list[Outcome]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=180, limits=limits) as client:

        async def one(job: Job) -> Outcome:
            async with gate:
                return await run_job(client, job)

        return list(await asyncio.gather(*(one(job) for job in jobs)))


async def run_job(client: httpx.AsyncClient, job: Job) -> Outcome:
    outcome = Outcome(job)
    if isinstance(job.body, bytes):
        request = client.build_request("POST", job.path, content=job.body, headers={"Content-Type": "application/json"})
    else:
        request = client.build_request("POST", job.path, json=job.body)
    if job.give_up_after_s is not None:
        try:
            response = await asyncio.wait_for(client.send(request), job.give_up_after_s)
        except asyncio.TimeoutError:
            return outcome  # the client went away; the server must abort the request
        return _plain(outcome, response)
    response = await client.send(request, stream=job.stream)
    if not job.stream or response.status_code != 200:
        await response.aread()
        return _plain(outcome, response)
    return await _streamed(outcome, response)


def _plain(outcome: Outcome, response: httpx.Response) -> Outcome:
    outcome.status = response.status_code
    try:
        outcome.body = response.json()
    except ValueError:
        outcome.problems.append(f"a body that is not JSON: {response.text[:200]!r}")
    return outcome


async def _streamed(outcome: Outcome, response: httpx.Response) -> Outcome:
    events: list[Any] = []
    try:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if outcome.job.disconnect_after is not None and len(events) > outcome.job.disconnect_after:
                return outcome  # hang up mid-stream (status stays None)
    finally:
        await response.aclose()
    outcome.status, outcome.body = response.status_code, events
    return outcome


def check(outcome: Outcome) -> list[str]:
    """What is wrong with one outcome (an empty list when nothing is)."""
    problems = list(outcome.problems)
    status, job = outcome.status, outcome.job
    if status is None:
        return problems  # hung up or gave up: nothing to check on the client's side
    if status >= 500:
        problems.append(f"{status}: {outcome.body}")
    elif status >= 400:
        problems += _check_error_body(outcome.body)
        if not job.expect_error:
            problems.append(f"a good request failed with {status}: {outcome.body}")
    elif job.expect_error:
        problems.append(f"a bad input was accepted ({status})")
    elif job.stream:
        problems += _check_stream(outcome.body)
    elif job.kind == "structured":
        problems += _check_structured(outcome.body)
    return [f"{job.kind} {job.path}: {p}" for p in problems]


def _check_error_body(body: Any) -> list[str]:
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"} or not error["message"]:
        return [f"not an OpenAI-style error body: {body!r}"]
    return []


def _check_stream(events: list[Any]) -> list[str]:
    if not events or events[-1] != "[DONE]":
        return ["the stream did not end with [DONE]"]
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    return [f"an error event in the stream: {errors[0]}"] if errors else []


def _check_structured(body: dict) -> list[str]:
    choice = body["choices"][0]
    if choice["finish_reason"] != "stop":
        return []  # cut by max_tokens: the text is a valid prefix, not a whole object
    value = json.loads(choice["message"]["content"])
    return [] if set(value) == {"name", "age"} and isinstance(value["age"], int) else [f"off-schema output {value}"]


def summarize(outcomes: list[Outcome], elapsed: float) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    for o in outcomes:
        key = "client hung up" if o.status is None else str(o.status)
        statuses[key] = statuses.get(key, 0) + 1
    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[o.job.kind] = kinds.get(o.job.kind, 0) + 1
    return {"requests": len(outcomes), "seconds": round(elapsed, 1), "statuses": statuses, "kinds": kinds}


def now() -> float:
    return time.monotonic()
