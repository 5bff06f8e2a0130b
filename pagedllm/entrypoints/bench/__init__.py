"""``pagedllm bench {throughput,latency,serve,prefix,dummy-model}``: seeded benchmarks that print a
table and, as the last stdout line, one JSON object (also written to ``--output-json PATH``).

Each command measures pagedllm next to its baselines (Hugging Face ``transformers``, llama.cpp)
or the machine's own limits in the same run; benchmarks/README.md has the full-run commands.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "throughput": ("throughput", "offline throughput of N requests (random or shared-prefix), vs HF / llama.cpp"),
    "latency": ("latency", "prefill and per-step decode time at batch 1/16/64/128 vs the machine's floor"),
    "serve": ("serve", "online: TTFT/TPOT/ITL/E2E percentiles against a running server (streaming)"),
    "prefix": ("prefix", "shared-system-prompt workload: hit rate and TTFT with and without prefix caching"),
}


def _module(name: str) -> Any:
    return importlib.import_module(f"pagedllm.entrypoints.bench.{name}")


def _run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.bench.common import emit

    report = _module(COMMANDS[args.bench_command][0]).run(args)
    emit(report, args)
    return 0


def _dummy_model(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.bench.common import write_dummy_model_dir

    path = write_dummy_model_dir(Path(args.path))
    print(f"wrote {path}: serve it with `pagedllm serve {path} --load-format dummy --dtype float32`")
    return 0


def add_bench_parser(sub: Any) -> None:
    """Register ``bench`` and its subcommands on the top-level CLI's subparsers."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks (throughput, latency, serve, prefix)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_sub = bench.add_subparsers(
        dest="bench_command", required=True, metavar="{" + ",".join([*COMMANDS, "dummy-model"]) + "}"
    )
    for name, (module, help_text) in COMMANDS.items():
        mod = _module(module)
        p = bench_sub.add_parser(
            name, help=help_text, description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        mod.add_args(p)
        p.set_defaults(func=_run)
    dummy = bench_sub.add_parser(
        "dummy-model",
        help="write the default benchmark model's config dir",
        description="Write config.json (SmolLM-135M shape) + tokenizer files to PATH.",
    )
    dummy.add_argument("path")
    dummy.set_defaults(func=_dummy_model)
