"""Structured output: what a JSON-schema constraint costs, measured against the same batch unconstrained.

    python -m benchmarks.structured_output [--shape smollm135m|demo | --model DIR] [--num-requests 64]

1. Grammar compile time: each schema compiled cold (a fresh compiler) and looked up again (cached).
2. Throughput: ONE ``LLM.generate`` call with --num-requests requests, every one carrying a JSON
   schema (greedy), then the same prompts unconstrained with ``max_tokens`` set to the exact
   length each constrained request produced (``ignore_eos``), so both runs compute the same
   tokens. Runs alternate --repeats times; the ratio constrained / unconstrained wall time - 1
   (best vs best, median vs median) is the cost of the constraint. One more constrained run
   times the grammar work itself (bitmask fill + logits masking + token accept), which on a busy
   machine is a steadier measure than the difference of two noisy wall times.

Models: ``smollm135m`` (default) is a random-weight Llama shaped like SmolLM-135M (vocab 49152,
30 layers; loaded with load_format="dummy", the demo tokenizer's 2048 tokens); ``demo`` is the
built-in tiny demo model (vocab 2048, 256 hidden), where a step is so cheap that the per-token
grammar work weighs the most. The last stdout line is the report as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench.common import SMOLLM_135M_SHAPE
from pagedllm.sampling_params import StructuredOutputsParams

_WEIGHT_FILES = {"config.json", "generation_config.json", "model.safetensors", "README.md"}

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
            "admin": {"type": "boolean"},
        },
        "required": ["name", "age", "email"],
    },
    {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["sku", "qty"],
            }
        },
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
            "status": {"type": "string", "enum": ["pending", "shipped", "delivered"]},
        },
        "required": ["order_id", "items", "status"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima", "Oslo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"anyOf": [{"type": "string", "enum": ["celsius", "fahrenheit"]}, {"type": "null"}]},
        },
        "required": ["city", "days", "unit"],
    },
    {
        "type": "array",
        "minItems": 1,
        "maxItems": 4,
        "items": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 1, "maxLength": 10},
                "score": {"type": "number", "minimum": 0, "maximum": 10},
            },
            "required": ["title", "score"],
        },
    },
]
PROMPT_WORDS = [
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
    "engine",
    "memory",
    "cache",
    "block",
    "token",
    "request",
]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.structured_output",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shape", default="smollm135m", choices=("smollm135m", "demo"))
    p.add_argument("--model", default=None, help="a real HF model dir instead of --shape")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def model_dir(args: argparse.Namespace, tmp: Path) -> tuple[str, str, str]:
    """(path, load_format, description)."""
    from pagedllm.demo.demo_model import ensure_demo_model

    if args.model:
        return args.model, "auto", args.model
    if args.shape == "demo":
        return str(ensure_demo_model()), "auto", "pagedllm-demo (llama, hidden 256, vocab 2048, random weights)"
    from transformers import LlamaConfig

    config = LlamaConfig(
        **SMOLLM_135M_SHAPE,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config.save_pretrained(str(tmp))
    for f in Path(ensure_demo_model()).iterdir():
        if f.is_file() and f.name not in _WEIGHT_FILES:
            shutil.copy(f, tmp / f.name)
    return str(tmp), "dummy", "dummy SmolLM-135M shape (vocab 49152, 30 layers, fp32, random weights)"


def prompts(n: int) -> list[str]:
    return [
        " ".join(PROMPT_WORDS[(i + j) % len(PROMPT_WORDS)] for j in range(8 + i % 5)) + f" #{i}. JSON:"
        for i in range(n)
    ]


# ---------------------------------------------------------------------------------- compile time
def compile_times(llm: LLM) -> dict[str, Any]:
    """Cold: a fresh xgrammar compiler per schema (its own cache empty); cached: our cache's lookup."""
    from pagedllm.structured_output.compiler import GrammarCompiler

    shared = llm.llm_engine.input_processor.grammar_compiler
    backend = shared.backend()
    cold, cached = [], []
    for schema in SCHEMAS:
        backend.compiler.clear_cache()
        fresh = GrammarCompiler(lambda: backend, timeout_s=60)
        params = StructuredOutputsParams(json=schema)
        start = time.perf_counter()
        fresh.check(params)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        fresh.check(params)
        cached.append(time.perf_counter() - start)
        fresh.shutdown()
    return {
        "cold_ms": [round(t * 1e3, 3) for t in cold],
        "cached_us": [round(t * 1e6, 1) for t in cached],
        "cold_ms_median": statistics.median(cold) * 1e3,
        "cached_us_median": statistics.median(cached) * 1e6,
    }


# ---------------------------------------------------------------------------------- throughput
def run(llm: LLM, texts: list[str], params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(texts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


class GrammarTimer:
    """Wall time spent in the engine's grammar work (bitmask fill, logits masking, token accept):
    a measure of the constraint's cost that run-to-run noise does not swamp."""

    def __init__(self) -> None:
        import pagedllm.worker.model_runner as model_runner
        from pagedllm.structured_output.manager import StructuredOutputManager
        from pagedllm.structured_output.request import StructuredOutputRequest

        self.seconds = 0.0
        self._patches = [
            (StructuredOutputManager, "grammar_bitmask"),
            (StructuredOutputRequest, "accept"),
            (model_runner, "apply_grammar_bitmask"),
        ]
        self._originals = [getattr(owner, name) for owner, name in self._patches]

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper

    def __enter__(self) -> GrammarTimer:
        for (owner, name), original in zip(self._patches, self._originals):
            setattr(owner, name, self._timed(original))
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), original in zip(self._patches, self._originals):
            setattr(owner, name, original)


def throughput(llm: LLM, n: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    texts = prompts(n)
    constrained = [
        SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]),
        )
        for i in range(n)
    ]
    run(llm, texts[:4], constrained[:4])  # warm-up (compiles the schemas once)
    _, outputs = run(llm, texts, constrained)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    plain = [SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True) for length in lengths]
    times: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    for _ in range(repeats):
        for name, params in (("unconstrained", plain), ("constrained", constrained)):
            elapsed, outs = run(llm, texts, params)
            assert [len(o.outputs[0].token_ids) for o in outs] == lengths, "runs must compute the same tokens"
            times[name].append(elapsed)
    with GrammarTimer() as timer:
        elapsed, _ = run(llm, texts, constrained)
    best = {name: min(values) for name, values in times.items()}
    tokens = sum(lengths)
    return {
        "requests": n,
        "output_tokens": tokens,
        "mean_output_len": tokens / n,
        "max_output_len": max(lengths),
        "finished_by_grammar": sum(o.outputs[0].finish_reason == "stop" for o in outputs),
        "valid": _count_valid(outputs),
        "seconds": times,
        "best_s": best,
        "tokens_per_s": {k: tokens / v for k, v in best.items()},
        "overhead": best["constrained"] / best["unconstrained"] - 1,
        "median_overhead": statistics.median(times["constrained"]) / statistics.median(times["unconstrained"]) - 1,
        "grammar_s": timer.seconds,
        "grammar_share": timer.seconds / elapsed,
    }


def _count_valid(outputs: list) -> int | None:
    try:
        import jsonschema
    except ImportError:
        return None
    valid = 0
    for i, output in enumerate(outputs):
        try:
            jsonschema.validate(json.loads(output.outputs[0].text), SCHEMAS[i % len(SCHEMAS)])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    env = (
        f"{datetime.date.today()} torch {torch.__version__} threads {torch.get_num_threads()} "
        f"cpu {platform.processor() or platform.machine()}"
    )
    with tempfile.TemporaryDirectory(prefix="pagedllm-so-bench-") as tmp:
        path, load_format, desc = model_dir(args, Path(tmp))
        llm = LLM(path, load_format=load_format, max_model_len=512, max_num_seqs=max(args.num_requests, 1))
        report = {
            "env": env,
            "model": desc,
            "compile": compile_times(llm),
            "throughput": throughput(llm, args.num_requests, args.max_tokens, args.repeats),
        }
    t, c = report["throughput"], report["compile"]
    print(env)
    print(f"model: {desc}")
    print(
        f"compile: cold median {c['cold_ms_median']:.2f} ms {c['cold_ms']}, "
        f"cached median {c['cached_us_median']:.1f} us"
    )
    print(
        f"{t['requests']} requests, {t['output_tokens']} output tokens (mean {t['mean_output_len']:.1f}, "
        f"max {t['max_output_len']}), {t['finished_by_grammar']} ended by the grammar, {t['valid']} valid"
    )
    for name in ("unconstrained", "constrained"):
        print(
            f"  {name:13s} best {t['best_s'][name]:.3f} s  {t['tokens_per_s'][name]:.1f} tok/s  "
            f"runs {[round(x, 3) for x in t['seconds'][name]]}"
        )
    print(
        f"  constraint overhead: best vs best {t['overhead'] * 100:+.1f}%, median vs median "
        f"{t['median_overhead'] * 100:+.1f}%; grammar work {t['grammar_s'] * 1e3:.0f} ms = "
        f"{t['grammar_share'] * 100:.1f}% of a constrained run"
    )
    line = json.dumps(report)
    if args.output_json:
        Path(args.output_json).write_text(line)
    print(line)
    return report


if __name__ == "__main__":
    main()
