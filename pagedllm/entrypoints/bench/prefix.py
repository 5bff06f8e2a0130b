"""``pagedllm bench prefix``: the prefix cache on a shared-system-prompt workload.

Two engines in one run, one after the other: prefix caching on, then off. Each serves

1. the workload: N requests = one of ``--num-prefixes`` shared prefixes + a random suffix, arriving
   in waves of ``--wave-size`` (a wave is added at once and run to completion): hit rate
   (``num_cached_tokens`` / prompt tokens), TTFT percentiles, wall time;
2. one long-prefix probe, ``--iters`` times: a request whose ``--cached-prefix-len``-token prefix
   an earlier request has already sent (so with caching on it is cached) plus a fresh suffix,
   1 output token; its TTFT with caching on vs off is the speed-up a cache hit buys.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any

from pagedllm.entrypoints.bench import common
from pagedllm.entrypoints.bench.datasets import BenchRequest, random_requests


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p)
    common.add_engine_args(p)
    common.add_dataset_args(
        p, default="prefix", choices=("prefix",), num_requests=64, prompt_len=(16, 64), output_len=(16, 32)
    )
    p.add_argument("--wave-size", type=int, default=8, help="requests added at once (default 8)")
    p.add_argument("--cached-prefix-len", type=int, default=1024, help="prefix tokens of the TTFT probe")
    p.add_argument("--probe-suffix-len", type=int, default=32, help="fresh tokens after the probe's prefix")
    p.add_argument("--iters", type=int, default=3, help="probe repetitions (median)")


def _engine(args: argparse.Namespace, model: common.BenchModel, caching: bool) -> Any:
    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    kwargs = common.engine_kwargs(args, model, enable_prefix_caching=caching)
    return LLMEngine.from_engine_args(EngineArgs(**kwargs))


def _add(engine: Any, prompt: list[int], max_tokens: int) -> str:
    from pagedllm.sampling_params import SamplingParams

    rid = engine.next_request_id()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    return rid


def _drain(engine: Any, added: dict[str, float], ttft: dict[str, float], cached: dict[str, int]) -> None:
    """Step until idle; record each request's time to first token and its cached prompt tokens."""
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id not in ttft and out.outputs and out.outputs[0].token_ids:
                ttft[out.request_id] = now - added[out.request_id]
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens


def run_workload(engine: Any, requests: list[BenchRequest], wave: int) -> dict[str, Any]:
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    cached: dict[str, int] = {}
    start = time.perf_counter()
    for i in range(0, len(requests), wave):
        for r in requests[i : i + wave]:
            added[_add(engine, r.prompt_token_ids, r.output_len)] = time.perf_counter()
        _drain(engine, added, ttft, cached)
    elapsed = time.perf_counter() - start
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    output = sum(r.output_len for r in requests)
    return {
        "hit_rate": sum(cached.values()) / prompt,
        "cached_tokens": sum(cached.values()),
        "prompt_tokens": prompt,
        "elapsed_s": elapsed,
        "output_tokens_per_s": output / elapsed,
        "ttft_s": common.summarize(list(ttft.values())),
    }


def probe_prompts(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[int]]]:
    """(the primer: the long prefix + its own suffix, the probes: the prefix + fresh suffixes)."""
    rng = random.Random(args.seed + 1)
    prefix = [rng.randrange(10, vocab) for _ in range(args.cached_prefix_len)]
    suffixes = random_requests(args.iters + 1, (args.probe_suffix_len,) * 2, (1, 1), vocab, args.seed + 2)
    return prefix + suffixes[0].prompt_token_ids, [prefix + s.prompt_token_ids for s in suffixes[1:]]


def run_probe(engine: Any, primer: list[int], probes: list[list[int]]) -> dict[str, Any]:
    ttft: dict[str, float] = {}
    cached: dict[str, int] = {}
    _drain(engine, {_add(engine, primer, 1): time.perf_counter()}, {}, {})
    times = []
    for prompt in probes:
        rid = _add(engine, prompt, 1)
        _drain(engine, {rid: time.perf_counter()}, ttft, cached)
        times.append(ttft[rid])
    return {
        "ttft_s": statistics.median(times),
        "cached_tokens": statistics.median(list(cached.values())),
        "prompt_tokens": len(probes[0]),
    }


def run_engine(
    args: argparse.Namespace, model: common.BenchModel, caching: bool, requests: list[BenchRequest], vocab: int
) -> dict[str, Any]:
    engine = _engine(args, model, caching)
    _drain(engine, {_add(engine, list(range(10, 26)), 2): time.perf_counter()}, {}, {})  # warm-up
    result = {
        "prefix_caching": caching,
        "workload": run_workload(engine, requests, args.wave_size),
        "probe": run_probe(engine, *probe_prompts(args, vocab)),
    }
    del engine
    gc.collect()
    return result


def format_results(results: list[dict[str, Any]]) -> str:
    header = (
        "prefix caching",
        "hit rate",
        "TTFT mean ms",
        "median ms",
        "p90 ms",
        "wall s",
        "out tok/s",
        "probe TTFT ms",
        "probe cached tok",
    )
    rows = []
    for r in results:
        w, t = r["workload"], r["workload"]["ttft_s"]
        rows.append(
            (
                "on" if r["prefix_caching"] else "off",
                f"{100 * w['hit_rate']:.1f}%",
                t["mean"] * 1e3,
                t["median"] * 1e3,
                t["p90"] * 1e3,
                w["elapsed_s"],
                w["output_tokens_per_s"],
                r["probe"]["ttft_s"] * 1e3,
                r["probe"]["cached_tokens"],
            )
        )
    return common.format_table(header, rows)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.wave_size < 1 or args.iters < 1 or args.cached_prefix_len < 1:
        raise ValueError("--wave-size, --iters and --cached-prefix-len must be >= 1")
    env = common.environment()
    with common.bench_model(args) as model:
        vocab, max_len = common.model_limits(model.path)
        if args.cached_prefix_len + args.probe_suffix_len + 1 > (args.max_model_len or max_len):
            raise ValueError("--cached-prefix-len + --probe-suffix-len exceed the model's context; lower them")
        requests = common.make_requests(args, vocab, max_len)
        results = [run_engine(args, model, caching, requests, vocab) for caching in (True, False)]
    on, off = results[0], results[1]
    speedup = off["probe"]["ttft_s"] / on["probe"]["ttft_s"]
    workload_speedup = off["workload"]["ttft_s"]["mean"] / on["workload"]["ttft_s"]["mean"]
    print(f"\n{model.desc}; {common.env_line(env)}\n")
    print(format_results(results))
    print(
        f"\nTTFT of a request whose {args.cached_prefix_len}-token prefix is cached: "
        f"{on['probe']['ttft_s'] * 1e3:.1f} ms vs {off['probe']['ttft_s'] * 1e3:.1f} ms uncached "
        f"= {speedup:.2f}x lower; workload mean TTFT {workload_speedup:.2f}x lower with caching"
    )
    return {
        "benchmark": "prefix",
        "model": model.desc,
        "env": env,
        "args": common.args_dict(args),
        "results": results,
        "cached_prefix_ttft_speedup": speedup,
        "workload_ttft_speedup": workload_speedup,
    }
