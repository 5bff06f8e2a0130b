"""Mixed load on a live server at concurrency 64: streamed and plain requests, n > 1, structured
output, long prompts, clients hanging up mid-stream, bad inputs interleaved. Afterwards: no 5xx,
every 4xx an OpenAI-style error body, nothing running or waiting, the KV cache idle, the block
pool whole, and the server's resident memory grown by a bounded amount."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.entrypoints.openai.conftest import assert_openai_error
from tests.server_checks import assert_idle_and_intact, assert_no_server_errors, engine_core_pid, rss_bytes

from .conftest import SOAK
from .workload import check, make_jobs, now, run_jobs, summarize

CONCURRENCY = 64
REQUESTS = 2000 if SOAK else 150
WARMUP = 32  # every kind of request once or more, so lazy imports and first compiles are done
MiB = 1024 * 1024
# Resident memory a run may add after the warm-up: caches that fill once (tokenizer, grammar
# compiler, allocator arenas) fit well within these; a per-request leak over the run does not.
MAX_FRONT_END_GROWTH = 64 * MiB
MAX_ENGINE_GROWTH = 128 * MiB


def _rss(server) -> tuple[int, int]:
    return rss_bytes(server.proc.pid), rss_bytes(engine_core_pid(server.proc.pid))


def test_mixed_load_leaves_the_server_clean(server):
    asyncio.run(run_jobs(server.url, make_jobs(WARMUP, seed=1), CONCURRENCY))
    assert_idle_and_intact(server.url)
    front_before, engine_before = _rss(server)
    jobs = make_jobs(REQUESTS, seed=2)
    started = now()
    outcomes = asyncio.run(run_jobs(server.url, jobs, CONCURRENCY))
    elapsed = now() - started
    problems = [p for o in outcomes for p in check(o)]
    assert not problems, "\n".join(problems[:20])
    assert_idle_and_intact(server.url)
    server_side = assert_no_server_errors(server.url)  # hung-up clients' answers included
    front_after, engine_after = _rss(server)
    summary = summarize(outcomes, elapsed) | {
        "server_side_error_counts": server_side,
        "front_end_rss_growth_mib": round((front_after - front_before) / MiB, 1),
        "engine_rss_growth_mib": round((engine_after - engine_before) / MiB, 1),
    }
    print("mixed load:", json.dumps(summary))  # the figures docs/benchmarks.md records
    assert summary["statuses"].get("200", 0) > REQUESTS // 2
    assert front_after - front_before < MAX_FRONT_END_GROWTH, summary
    assert engine_after - engine_before < MAX_ENGINE_GROWTH, summary


def test_min_tokens_past_the_room_left_is_a_400_and_the_engine_lives(server):
    """Found by the fuzzer: min_tokens above max_model_len - prompt (no max_tokens) reached the
    engine process unchecked, failed its message decoding there and stopped the engine."""
    resp = httpx.post(server.url_for("v1", "completions"), json={"model": "tiny", "prompt": "x", "min_tokens": 600})
    assert assert_openai_error(resp, 400)["param"] == "min_tokens"
    assert httpx.get(server.url_for("health")).status_code == 200
    assert_idle_and_intact(server.url)
