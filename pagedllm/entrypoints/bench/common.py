"""Shared pieces of the ``pagedllm bench`` commands: the default model, engine flags, request sets,
the environment line, tables, statistics and the JSON report."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.config.choices import LOAD_FORMATS, canonical_dtype
from pagedllm.entrypoints.bench.datasets import (
    BenchRequest,
    long_prompt_mix_requests,
    prefix_sharing_requests,
    random_requests,
)
from pagedllm.entrypoints.cli_args import add_engine_fields

# SmolLM-135M's shape; token ids 0..2 match the demo tokenizer copied next to it.
SMOLLM_135M_SHAPE: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
DUMMY_MODEL_DESC = "dummy SmolLM-135M shape (random weights)"
_NOT_TOKENIZER_FILES = {"config.json", "generation_config.json", "model.safetensors", "README.md"}


# ---------------------------------------------------------------------------------------------- model
def write_dummy_model_dir(path: Path) -> Path:
    """config.json for the SmolLM-135M shape + the demo model's tokenizer files (no weights):
    load it with ``load_format="dummy"`` (``pagedllm serve DIR --load-format dummy``)."""
    from transformers import LlamaConfig

    from pagedllm.demo.demo_model import ensure_demo_model

    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        **SMOLLM_135M_SHAPE,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config.save_pretrained(str(path))
    for f in Path(ensure_demo_model()).iterdir():
        if f.is_file() and f.name not in _NOT_TOKENIZER_FILES:
            shutil.copy(f, path / f.name)
    return path


def is_gguf(model: str | Path) -> bool:
    """Whether ``model`` names a GGUF file (the benchmarks then read its header, not config.json)."""
    return Path(model).suffix.lower() == ".gguf" and Path(model).is_file()


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """The model's config.json as a dict, or for a GGUF file the fields the benchmarks read
    (shapes, vocabulary, context length) from its header."""
    if is_gguf(model_dir):
        from pagedllm.gguf_config import gguf_arch_config

        arch = gguf_arch_config(model_dir)
        return {
            "vocab_size": arch.vocab_size,
            "hidden_size": arch.hidden_size,
            "intermediate_size": arch.intermediate_size,
            "num_hidden_layers": arch.num_hidden_layers,
            "num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.num_key_value_heads,
            "head_dim": arch.head_dim,
            "max_position_embeddings": arch.max_position_embeddings,
            "attention_bias": arch.attention_bias,
        }
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return {**config.get("text_config", {}), **config}


def model_limits(model_dir: Path) -> tuple[int, int]:
    """(vocab_size, max_position_embeddings) from config.json."""
    config = read_hf_config(model_dir)
    return int(config["vocab_size"]), int(config.get("max_position_embeddings", 2048))


@dataclass(frozen=True)
class BenchModel:
    """The model a benchmark runs: its directory, how to load it, and a one-line description."""

    path: Path
    load_format: str
    dummy: bool  # random weights: baselines build their own random weights from config.json
    desc: str


@contextlib.contextmanager
def bench_model(args: argparse.Namespace) -> Iterator[BenchModel]:
    """``--model DIR`` as given, else a temp dir with the dummy SmolLM-135M shape (removed after)."""
    if args.model is not None:
        load_format = args.load_format or "auto"
        yield BenchModel(
            Path(args.model),
            load_format,
            load_format == "dummy",
            f"{args.model} ({args.dtype}, load_format={load_format})",
        )
        return
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-") as tmp:
        yield BenchModel(
            write_dummy_model_dir(Path(tmp)), args.load_format or "dummy", True, f"{DUMMY_MODEL_DESC}, {args.dtype}"
        )


# ---------------------------------------------------------------------------------------------- flags
def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="HF model dir or GGUF file (llama.cpp then runs the same file); default: dummy-weight SmolLM-135M shape",
    )
    p.add_argument(
        "--load-format",
        default=None,
        choices=LOAD_FORMATS,
        help="default: dummy for the default model, auto for --model",
    )
    add_engine_fields(
        p,
        ["dtype", "device", "seed"],
        defaults={"dtype": "float32", "device": "cpu"},
        notes={"dtype": "float32 is the fastest on CPU", "seed": "also seeds the requests and the baselines"},
    )
    p.add_argument("--output-json", default=None, metavar="PATH", help="also write the JSON report here")


def add_engine_args(p: argparse.ArgumentParser, max_num_seqs: int = 256) -> None:
    names = [
        "max_num_seqs",
        "max_num_batched_tokens",
        "kv_cache_memory",
        "kv_cache_dtype",
        "max_model_len",
        "quantization",
    ]
    add_engine_fields(
        p.add_argument_group("engine"),
        [*names, "enforce_eager"],
        defaults={"max_num_seqs": max_num_seqs},
        notes={"quantization": "the floors still count float32 weight bytes"},
    )


def add_limits_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("machine limits (measured in the same run)")
    g.add_argument(
        "--bandwidth",
        choices=("copy", "read"),
        default="copy",
        help="which measured bandwidth the floors use (default copy: bytes read + written)",
    )
    g.add_argument("--limits-copy-mib", type=int, default=512, help="size of the bandwidth probe's tensor")
    g.add_argument("--limits-gemm-n", type=int, default=2048, help="size of the GEMM probe's square matrices")


def measure_limits(args: argparse.Namespace) -> Any:
    """``machine.MachineLimits`` measured with the model's dtype and the limits flags."""
    import torch

    from pagedllm.entrypoints.bench import machine

    name = canonical_dtype(args.dtype)
    return machine.measure_limits(
        getattr(torch, name), args.limits_copy_mib, args.limits_gemm_n, bandwidth=args.bandwidth
    )


def engine_kwargs(args: argparse.Namespace, model: BenchModel, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``LLM`` / ``EngineArgs`` from the common and engine flags."""
    kwargs: dict[str, Any] = dict(
        model=str(model.path),
        load_format=model.load_format,
        dtype=args.dtype,
        seed=args.seed,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
    )
    for name in ("max_num_batched_tokens", "kv_cache_memory", "kv_cache_dtype", "max_model_len", "quantization"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    if getattr(args, "enforce_eager", False):
        kwargs["enforce_eager"] = True
    kwargs.update(overrides)
    return kwargs


def add_dataset_args(
    p: argparse.ArgumentParser,
    default: str = "random",
    choices: Sequence[str] = ("random", "prefix"),
    num_requests: int = 256,
    prompt_len: tuple[int, int] = (32, 512),
    output_len: tuple[int, int] = (16, 256),
) -> None:
    g = p.add_argument_group("requests (seeded)")
    g.add_argument("--dataset", default=default, choices=tuple(choices))
    g.add_argument("--num-requests", type=int, default=num_requests)
    g.add_argument(
        "--prompt-len",
        type=int,
        nargs=2,
        default=list(prompt_len),
        metavar=("MIN", "MAX"),
        help="random: prompt lengths; prefix: per-request suffix lengths; long-prompts-mix: the short prompts",
    )
    g.add_argument("--output-len", type=int, nargs=2, default=list(output_len), metavar=("MIN", "MAX"))
    g.add_argument("--prefix-len", type=int, default=512, help="prefix: shared prefix tokens")
    g.add_argument("--num-prefixes", type=int, default=1, help="prefix: distinct shared prefixes")
    if "long-prompts-mix" in choices:
        g.add_argument("--long-prompt-len", type=int, nargs=2, default=[1024, 1536], metavar=("MIN", "MAX"))
        g.add_argument("--long-output-len", type=int, nargs=2, default=[16, 32], metavar=("MIN", "MAX"))
        g.add_argument("--long-fraction", type=float, default=0.125, help="share of long-prompt requests")


def make_requests(args: argparse.Namespace, vocab_size: int, max_len: int) -> list[BenchRequest]:
    """The seeded request set the dataset flags describe; checked against the model's context."""
    out = tuple(args.output_len)
    if args.dataset == "prefix":
        reqs = prefix_sharing_requests(
            args.num_requests, args.prefix_len, tuple(args.prompt_len), out, vocab_size, args.seed, args.num_prefixes
        )
    elif args.dataset == "long-prompts-mix":
        reqs = long_prompt_mix_requests(
            args.num_requests,
            tuple(args.prompt_len),
            tuple(args.long_prompt_len),
            out,
            tuple(args.long_output_len),
            args.long_fraction,
            vocab_size,
            args.seed,
        )
    else:
        reqs = random_requests(args.num_requests, tuple(args.prompt_len), out, vocab_size, args.seed)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    if longest > max_len:
        raise SystemExit(
            f"a request needs {longest} tokens (prompt + output) but the model's context is "
            f"{max_len}; lower the length flags"
        )
    return reqs


# ---------------------------------------------------------------------------------------------- report
def environment() -> dict[str, Any]:
    import torch

    return {
        "date": now(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def env_line(env: dict[str, Any]) -> str:
    return f"{env['date']}; torch {env['torch']}, {env['threads']} threads, {env['cpu']}"


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned first column, right-aligned others; floats to 3 significant-ish digits."""
    cells = [list(header)] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, median, p90, p99 (0.0 for an empty list, so reports keep their keys)."""
    import numpy as np

    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    arr = np.asarray(values, dtype=float)
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
    }


def emit(report: dict[str, Any], args: argparse.Namespace) -> None:
    """The report as the last stdout line (and to ``--output-json``)."""
    line = json.dumps(report, default=str)
    print(line, flush=True)
    if getattr(args, "output_json", None):
        Path(args.output_json).write_text(line + "\n")


def args_dict(args: argparse.Namespace) -> dict[str, Any]:
    """The flags, JSON-safe (``inf`` as a string: strict JSON has no infinity)."""
    return {k: ("inf" if v == float("inf") else v) for k, v in vars(args).items() if not callable(v)}


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
