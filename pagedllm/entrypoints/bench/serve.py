"""``pagedllm bench serve``: online latency against a running server, over HTTP with streaming.

Sends seeded token-id prompts to ``POST /v1/completions`` (``stream: true``, ``ignore_eos``,
exact ``max_tokens``) with Poisson arrivals at ``--request-rate`` (``inf``: all at once) and at
most ``--max-concurrency`` in flight. Per request: TTFT (send -> first token chunk), ITL (gaps
between token chunks), TPOT ((E2E - TTFT) / (output tokens - 1)) and E2E; summarized as mean,
median, p90, p99, with request and token throughput and the failed-request count.

Start the server first, e.g. ``pagedllm bench dummy-model /tmp/smol && pagedllm serve /tmp/smol
--load-format dummy --dtype float32``; ``--model DIR`` (the served dir) sets the token-id range.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.bench import common
from pagedllm.entrypoints.bench.datasets import BenchRequest


@dataclass
class RequestRecord:
    prompt_len: int
    expected_output: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--model", default=None, help="the served model's HF dir or GGUF file: token-id range and context length"
    )
    p.add_argument("--served-model-name", default=None, help="default: the first id of GET /v1/models")
    p.add_argument("--vocab-size", type=int, default=None, help="without --model (default 49152: SmolLM-135M)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per s (default inf)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default no cap)")
    p.add_argument("--num-warmups", type=int, default=1, help="short untimed requests first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, metavar="PATH")
    common.add_dataset_args(
        p, choices=("random", "prefix", "long-prompts-mix"), num_requests=64, prompt_len=(32, 256), output_len=(16, 256)
    )


# ---------------------------------------------------------------------------------------------- client
def _payload(model: str, request: BenchRequest) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send(client: Any, url: str, headers: dict[str, str], model: str, request: BenchRequest) -> RequestRecord:
    rec = RequestRecord(len(request.prompt_token_ids), request.output_len)
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=_payload(model, request), headers=headers) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            chunks = await _read_stream(resp, rec, start)
    except Exception as exc:  # a failed request is counted and reported, not fatal
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    rec.e2e = time.perf_counter() - start
    rec.output_tokens = rec.output_tokens or chunks
    rec.success = chunks > 0
    rec.error = "" if rec.success else "no token chunks"
    return rec


async def _read_stream(resp: Any, rec: RequestRecord, start: float) -> int:
    """Record TTFT and the gaps between token chunks of one SSE stream; returns the chunk count."""
    chunks, last = 0, start
    async for line in resp.aiter_lines():
        data = line[5:].strip() if line.startswith("data:") else ""
        if not data or data == "[DONE]":
            continue
        chunk = json.loads(data)
        if chunk.get("usage"):
            rec.output_tokens = chunk["usage"].get("completion_tokens", 0)
        if chunk.get("choices"):
            now = time.perf_counter()
            if chunks:
                rec.itl.append(now - last)
            else:
                rec.ttft = now - start
            chunks, last = chunks + 1, now
    return chunks


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson process, or all at 0."""
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def run_requests(args: argparse.Namespace, model: str, requests: list[BenchRequest]) -> tuple[list, float]:
    import httpx

    url = f"{args.base_url.rstrip('/')}/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        for _ in range(args.num_warmups):
            await send(client, url, headers, model, BenchRequest(list(range(10, 26)), 4))
        offsets = arrival_offsets(len(requests), args.request_rate, args.seed)
        start = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            if limit is None:
                return await send(client, url, headers, model, request)
            async with limit:
                return await send(client, url, headers, model, request)

        records = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
        return list(records), time.perf_counter() - start


def served_model(args: argparse.Namespace) -> str:
    import httpx

    if args.served_model_name:
        return args.served_model_name
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        resp = httpx.get(f"{args.base_url.rstrip('/')}/v1/models", headers=headers, timeout=10)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        raise SystemExit(
            f"no server answers at {args.base_url} ({exc}); start one with `pagedllm serve` or pass --base-url"
        ) from exc
    return resp.json()["data"][0]["id"]


# ---------------------------------------------------------------------------------------------- report
def metrics(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    itl = [gap for r in ok for gap in r.itl]
    itl_stats = common.summarize(itl)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
        "total_output_tokens": out_tokens,
        "short_outputs": sum(1 for r in ok if r.output_tokens != r.expected_output),
        "ttft_s": common.summarize([r.ttft for r in ok]),
        "tpot_s": common.summarize([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl_s": itl_stats,
        "e2e_s": common.summarize([r.e2e for r in ok]),
        "itl_p99_over_median": itl_stats["p99"] / itl_stats["median"] if itl_stats["median"] else None,
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def format_results(m: dict[str, Any]) -> str:
    rows = [
        (name, *(m[key][s] * 1e3 for s in ("mean", "median", "p90", "p99")))
        for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))
    ]
    table = common.format_table(("ms", "mean", "median", "p90", "p99"), rows)
    ratio = m["itl_p99_over_median"]
    return (
        f"{table}\ncompleted {m['completed']}, failed {m['failed']} in {m['duration_s']:.2f} s: "
        f"{m['request_throughput']:.2f} req/s, {m['output_throughput']:.1f} output tok/s, "
        f"{m['total_token_throughput']:.1f} total tok/s; ITL p99/median "
        f"{'-' if ratio is None else f'{ratio:.2f}'}"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.model is not None:
        vocab, max_len = common.model_limits(args.model)
    else:
        vocab, max_len = args.vocab_size or common.SMOLLM_135M_SHAPE["vocab_size"], 2048
    model = served_model(args)
    requests = common.make_requests(args, vocab, max_len)
    records, duration = asyncio.run(run_requests(args, model, requests))
    m = metrics(records, duration)
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}/s"
    print(
        f"\n{args.base_url} model {model}; dataset {args.dataset}, {len(requests)} requests, rate {rate}, "
        f"max concurrency {args.max_concurrency or 'none'}; {common.environment()['date']}\n"
    )
    print(format_results(m))
    return {
        "benchmark": "serve",
        "base_url": args.base_url,
        "model": model,
        "date": common.now(),
        "args": common.args_dict(args),
        **m,
    }
