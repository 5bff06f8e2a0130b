"""``--quantization w8a8`` against float32: decode and prefill tok/s in one process, interleaved.

    PAGEDLLM_CPU_ISA=avx2 python -m benchmarks.w8a8_speed [--batch-sizes 1 16 64] [--rounds 5]

Two engines on the SmolLM-135M-shaped dummy model (float32 random weights; the w8a8 engine
quantizes them after loading). Decode: each engine holds a batch of B running requests (prompts
of ``--prompt-len`` tokens); each round times ``--steps`` decode steps of one engine, then of the
other, the order alternating per round, so the machine's noise hits both alike. Prefill: one
``--prefill-len``-token prompt per engine per round, alternating likewise. Reported: the median
over rounds of tok/s (B / step time; prompt tokens / prefill time) and the w8a8 / fp32 ratio. The
kernels' ISA level is ``PAGEDLLM_CPU_ISA`` (default: the best this CPU runs). The last stdout
line is the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.bench.common import env_line, environment, format_table, write_dummy_model_dir
from pagedllm.entrypoints.bench.latency import step_until_first_tokens
from pagedllm.layers.cpu_kernels import kernel_build
from pagedllm.sampling_params import SamplingParams

METHODS = (None, "w8a8")


def _add(engine: Any, rng: random.Random, prompt_len: int, max_tokens: int) -> str:
    rid = engine.next_request_id()
    prompt = [rng.randrange(10, 30000) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    return rid


def _start_batch(engine: Any, rng: random.Random, batch: int, prompt_len: int, max_tokens: int) -> list[str]:
    """B running requests, each past its prefill (its first token out)."""
    ids = [_add(engine, rng, prompt_len, max_tokens) for _ in range(batch)]
    step_until_first_tokens(engine, ids)
    return ids


def _time_steps(engine: Any, steps: int, batch: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        if len(engine.step()) != batch:
            raise RuntimeError("a decode step lost a request of the batch")
    return (time.perf_counter() - start) / steps


def _time_prefill(engine: Any, rng: random.Random, prompt_len: int) -> float:
    _add(engine, rng, prompt_len, 1)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def _alternating(rounds: int, run: Any) -> dict[str | None, list[float]]:
    """run(method) -> seconds, for each method per round, the order alternating per round."""
    times: dict[str | None, list[float]] = {m: [] for m in METHODS}
    for r in range(rounds):
        for m in METHODS if r % 2 == 0 else METHODS[::-1]:
            times[m].append(run(m))
    return times


def measure(args: argparse.Namespace, model_dir: Path) -> list[dict[str, Any]]:
    engines = {
        m: LLMEngine.from_engine_args(
            EngineArgs(
                model=str(model_dir),
                load_format="dummy",
                dtype="float32",
                device="cpu",
                quantization=m,
                kv_cache_memory=args.kv_cache_gib,
                max_model_len=args.max_model_len,
                seed=args.seed,
            )
        )
        for m in METHODS
    }
    rng = random.Random(args.seed)
    rows = []
    total = args.warmup + args.rounds * args.steps + 4
    for batch in args.batch_sizes:
        ids = {m: _start_batch(engines[m], rng, batch, args.prompt_len, total) for m in METHODS}
        for m in METHODS:
            _time_steps(engines[m], args.warmup, batch)
        times = _alternating(args.rounds, lambda m, b=batch: _time_steps(engines[m], args.steps, b))
        for m in METHODS:
            engines[m].abort_request(ids[m])
        rows.append({"phase": "decode", "batch": batch, **_rates(times, batch)})
    for m in METHODS:
        _time_prefill(engines[m], rng, args.prefill_len)  # warm-up
    times = _alternating(args.rounds, lambda m: _time_prefill(engines[m], rng, args.prefill_len))
    rows.append({"phase": "prefill", "batch": 1, "tokens": args.prefill_len, **_rates(times, args.prefill_len)})
    return rows


def _rates(times: dict[str | None, list[float]], tokens: int) -> dict[str, float]:
    fp32, w8 = (tokens / statistics.median(times[m]) for m in METHODS)
    return {"fp32_tok_s": fp32, "w8a8_tok_s": w8, "ratio": w8 / fp32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of each decode request")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per engine and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps per engine and batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args, write_dummy_model_dir(Path(tmp) / "model"))
    report = {"env": env_line(environment()), "kernels": kernel_build(), "rows": rows}
    print(f"{report['env']}; kernels {report['kernels']}")
    header = ["phase", "batch", "fp32 tok/s", "w8a8 tok/s", "w8a8 / fp32"]
    table = [
        [r["phase"], r["batch"], f"{r['fp32_tok_s']:.1f}", f"{r['w8a8_tok_s']:.1f}", f"{r['ratio']:.2f}x"] for r in rows
    ]
    print(format_table(header, table))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
