"""Interleaved A/B of two commits on the same machine: ``pagedllm bench latency`` and the mixed
64-request ``pagedllm bench throughput``, alternating base and new run by run so that drift in
the machine's speed hits both sides alike.

    python -m benchmarks.ab_compare --base 06e3832 --new HEAD --rounds 3 [--temperature 1.0]
        [--benchmarks latency] [--decode-prompt-len 1000] [--quantization int8]

Each commit is checked out into a temporary git worktree and run from there
(``PYTHONPATH=<worktree>``), so the package under test is exactly that commit. Prints one
table of medians per figure with the ratio new / base, and writes the raw reports as JSON
(``--output-json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LATENCY = [
    "bench",
    "latency",
    "--batch-sizes",
    "1",
    "16",
    "64",
    "--decode-steps",
    "16",
    "--prefill-len",
    "512",
    "--prefill-iters",
    "3",
]
MIXED = [
    "bench",
    "throughput",
    "--num-requests",
    "64",
    "--prompt-len",
    "32",
    "256",
    "--output-len",
    "16",
    "256",
    "--disable-detokenize",
]


def checkout(ref: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(where), ref], check=True)
    return where


def run_bench(tree: Path, argv: list[str], out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", *argv, "--output-json", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def latency_figures(report: dict) -> dict[str, float]:
    """tok/s per figure ("decode b1", "prefill 512", ...)."""
    figures = {}
    for r in report["results"]:
        if r["system"] != "pagedllm":
            continue
        name = f"decode b{r['batch']}" if r["figure"] == "decode" else f"prefill {r['tokens']}"
        figures[name] = r["tokens_per_s"]
    return figures


def mixed_figures(report: dict) -> dict[str, float]:
    rows = [r for r in report["results"] if r["system"] == "pagedllm"]
    return {"mixed 64 useful tok/s": rows[0]["output_tokens_per_s"]}


BENCHMARKS = {"latency": (LATENCY, latency_figures), "mixed": (MIXED, mixed_figures)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git ref of the baseline")
    p.add_argument("--new", default="HEAD", help="git ref under test (default HEAD)")
    p.add_argument("--rounds", type=int, default=3, help="base/new pairs per benchmark (default 3)")
    p.add_argument(
        "--benchmarks",
        nargs="+",
        choices=sorted(BENCHMARKS),
        default=sorted(BENCHMARKS),
        help="which to run (default: both)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="passed to bench latency (both refs must know the flag; default: its greedy decoding)",
    )
    p.add_argument(
        "--decode-prompt-len",
        type=int,
        default=None,
        help="passed to bench latency: each decode sequence's context (default: its short prompts)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        help="passed to both benchmarks (e.g. int8, int4, w8a8; default: float32 weights)",
    )
    p.add_argument("--output-json", default=None, metavar="PATH")
    args = p.parse_args()
    latency, mixed = list(LATENCY), list(MIXED)
    if args.temperature is not None:
        latency += ["--temperature", str(args.temperature)]
    if args.decode_prompt_len is not None:
        latency += ["--decode-prompt-len", str(args.decode_prompt_len)]
    if args.quantization is not None:
        latency += ["--quantization", args.quantization]
        mixed += ["--quantization", args.quantization]
    BENCHMARKS["latency"] = (latency, latency_figures)
    BENCHMARKS["mixed"] = (mixed, mixed_figures)
    samples: dict[str, dict[str, list[float]]] = {"base": {}, "new": {}}
    with tempfile.TemporaryDirectory(prefix="pagedllm-ab-") as tmp:
        trees = {side: checkout(getattr(args, side), Path(tmp) / side) for side in ("base", "new")}
        try:
            for bench, parse in (BENCHMARKS[name] for name in args.benchmarks):
                for i in range(args.rounds):
                    order = ("base", "new") if i % 2 == 0 else ("new", "base")
                    for side in order:
                        figures = parse(run_bench(trees[side], bench, Path(tmp) / f"{side}-{i}.json"))
                        for name, value in figures.items():
                            samples[side].setdefault(name, []).append(value)
                        print(f"{bench[1]} round {i + 1} {side}: {figures}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    print(f"\n| figure | base tok/s (median of {args.rounds}) | new tok/s | new / base |\n|---|---|---|---|")
    for name, base in samples["base"].items():
        b, n = statistics.median(base), statistics.median(samples["new"][name])
        print(f"| {name} | {b:.1f} | {n:.1f} | {n / b:.3f} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
