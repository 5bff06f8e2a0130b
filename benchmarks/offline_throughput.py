"""Offline throughput: pagedllm vs. Hugging Face ``generate`` on the same seeded requests, same run.

    python -m benchmarks.offline_throughput [--num-requests 256] [--hf-one-at-a-time-requests K] ...

By default the model is a random-weight Llama shaped like SmolLM-135M (config.json written to a
temp dir; pagedllm loads it with load_format="dummy"). ``--model DIR`` benchmarks a real HF dir.
Prints a table and one JSON line; ``--output-json PATH`` also writes the JSON there.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from benchmarks import hf_baseline
from benchmarks.datasets import BenchRequest, random_requests, total_output_tokens, total_prompt_tokens

# SmolLM-135M's shape; token ids 0..2 match the demo tokenizer copied next to it.
SMOLLM_135M_SHAPE: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
    rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=2,
)
_NOT_TOKENIZER_FILES = {"config.json", "generation_config.json", "model.safetensors", "README.md"}


@dataclass(frozen=True)
class SystemResult:
    system: str
    requests: int
    prompt_tokens: int
    output_tokens: int  # useful: each request's own output length
    generated_tokens: int  # output tokens actually computed (padded batches compute more)
    elapsed_s: float
    note: str = ""

    def rates(self) -> dict[str, float]:
        return {"requests_per_s": self.requests / self.elapsed_s,
                "output_tokens_per_s": self.output_tokens / self.elapsed_s,
                "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / self.elapsed_s}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), **self.rates()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.offline_throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (real weights); default: dummy SmolLM-135M shape")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="for both systems")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=float, default=None, help="GiB (CPU); engine default if unset")
    p.add_argument("--disable-detokenize", action="store_true", help="pagedllm: skip detokenizing outputs")
    p.add_argument("--skip-hf", action="store_true", help="run pagedllm only")
    p.add_argument("--hf-one-at-a-time-requests", type=int, default=None, metavar="K",
                   help="run HF one-at-a-time on the first K requests only (0: skip; default: all)")
    p.add_argument("--hf-batch-requests", type=int, default=None, metavar="K",
                   help="run HF padded batches on the first K requests only (0: skip; default: all)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--output-json", default=None, help="also write the JSON result to this file")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- model
def write_dummy_model_dir(path: Path) -> Path:
    """config.json for the SmolLM-135M shape + the demo model's tokenizer files (no weights)."""
    from transformers import LlamaConfig

    from pagedllm.models.tiny import ensure_demo_model

    config = LlamaConfig(**SMOLLM_135M_SHAPE, architectures=["LlamaForCausalLM"], dtype="float32",
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config.save_pretrained(str(path))
    for f in Path(ensure_demo_model()).iterdir():
        if f.is_file() and f.name not in _NOT_TOKENIZER_FILES:
            shutil.copy(f, path / f.name)
    return path


def model_limits(model_dir: Path) -> tuple[int, int]:
    """(vocab_size, max_position_embeddings) from config.json."""
    config = json.loads((model_dir / "config.json").read_text())
    config = {**config.get("text_config", {}), **config}
    return int(config["vocab_size"]), int(config.get("max_position_embeddings", 2048))


# ---------------------------------------------------------------------------------------------- pagedllm
def run_pagedllm(model_dir: Path, dummy: bool, requests: list[BenchRequest],
                 args: argparse.Namespace) -> tuple[SystemResult, float]:
    """(result of ONE timed generate over all requests, start-up seconds incl. a short warm-up)."""
    from pagedllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy" if dummy else "auto", dtype="float32", seed=args.seed,
              device=args.device, **_engine_kwargs(args))
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(10, 26))}], warm, use_tqdm=False)
    startup = time.perf_counter() - start
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True,
                             detokenize=not args.disable_detokenize) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    del llm, outputs
    gc.collect()
    _check_pagedllm_lengths(generated, requests)
    result = SystemResult("pagedllm", len(requests), total_prompt_tokens(requests), sum(generated),
                          sum(generated), elapsed, "one LLM.generate call, continuous batching")
    return result, startup


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"max_num_seqs": args.max_num_seqs}
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = args.kv_cache_memory
    return kwargs


def _check_pagedllm_lengths(generated: list[int], requests: list[BenchRequest]) -> None:
    wrong = [(i, g, r.output_len) for i, (g, r) in enumerate(zip(generated, requests)) if g != r.output_len]
    if wrong:
        raise RuntimeError(f"pagedllm generated the wrong number of tokens for {len(wrong)} requests "
                           f"(index, got, expected): {wrong[:5]}")


# ---------------------------------------------------------------------------------------------- HF
def run_hf(model_dir: Path, dummy: bool, requests: list[BenchRequest],
           args: argparse.Namespace) -> list[SystemResult]:
    single = _subset(requests, args.hf_one_at_a_time_requests)
    batched = _subset(requests, args.hf_batch_requests)
    if not single and not batched:
        return []
    model = hf_baseline.load_hf_model(model_dir, dummy, args.seed).to(args.device)
    hf_baseline.warm_up(model)
    results = []
    if single:
        run = hf_baseline.run_one_at_a_time(model, single)
        results.append(_hf_result("hf-one-at-a-time", single, run, len(requests), "batch size 1"))
    if batched:
        run = hf_baseline.run_padded_batches(model, batched, args.hf_batch_size)
        note = f"left-padded batches of {args.hf_batch_size}, dataset order"
        results.append(_hf_result(f"hf-batch-{args.hf_batch_size}", batched, run, len(requests), note))
    return results


def _subset(requests: list[BenchRequest], k: int | None) -> list[BenchRequest]:
    if k is None:
        return requests
    if k < 0:
        raise ValueError(f"a request count must be >= 0, got {k}")
    return requests[:k]


def _hf_result(system: str, subset: list[BenchRequest], run: hf_baseline.HFRun, total: int,
               note: str) -> SystemResult:
    if len(subset) < total:
        note += f"; SUBSET: first {len(subset)} of {total} requests"
    return SystemResult(system, len(subset), total_prompt_tokens(subset), run.useful_output_tokens,
                        run.generated_tokens, run.elapsed_s, note)


# ---------------------------------------------------------------------------------------------- report
def environment() -> dict[str, Any]:
    import transformers

    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(), "cpu": cpu_model()}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def format_table(results: list[SystemResult]) -> str:
    paged = next((r for r in results if r.system == "pagedllm"), None)
    header = ("system", "reqs", "prompt tok", "output tok", "wall s", "req/s", "out tok/s", "total tok/s",
              "pagedllm x")
    rows = [header]
    for r in results:
        rates = r.rates()
        ratio = "" if paged is None or r is paged else f"{_ratio(paged, r):.2f}"
        rows.append((r.system, str(r.requests), str(r.prompt_tokens), str(r.output_tokens), f"{r.elapsed_s:.2f}",
                     f"{rates['requests_per_s']:.3f}", f"{rates['output_tokens_per_s']:.1f}",
                     f"{rates['total_tokens_per_s']:.1f}", ratio))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines += [f"  {r.system}: {r.note}" for r in results if r.note]
    return "\n".join(lines)


def _ratio(paged: SystemResult, baseline: SystemResult) -> float:
    return paged.rates()["output_tokens_per_s"] / baseline.rates()["output_tokens_per_s"]


def build_report(args: argparse.Namespace, model_desc: str, startup_s: float,
                 results: list[SystemResult]) -> dict[str, Any]:
    paged = next(r for r in results if r.system == "pagedllm")
    return {"benchmark": "offline_throughput", "model": model_desc, "env": environment(),
            "args": vars(args), "pagedllm_startup_s": startup_s,
            "results": [r.to_dict() for r in results],
            "pagedllm_output_tok_s_ratio": {r.system: _ratio(paged, r) for r in results if r is not paged}}


# ---------------------------------------------------------------------------------------------- main
def make_requests(args: argparse.Namespace, vocab_size: int, max_len: int) -> list[BenchRequest]:
    if args.prompt_len[1] + args.output_len[1] > max_len:
        raise SystemExit(f"--prompt-len max + --output-len max = {args.prompt_len[1] + args.output_len[1]} "
                         f"exceeds the model's max_position_embeddings ({max_len}); lower them")
    return random_requests(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab_size,
                           args.seed)


def run(args: argparse.Namespace, model_dir: Path, dummy: bool) -> dict[str, Any]:
    requests = make_requests(args, *model_limits(model_dir))
    paged, startup = run_pagedllm(model_dir, dummy, requests, args)
    results = [paged] + ([] if args.skip_hf else run_hf(model_dir, dummy, requests, args))
    model_desc = "dummy SmolLM-135M shape (random weights, fp32)" if dummy else f"{args.model} (fp32)"
    report = build_report(args, model_desc, startup, results)
    env = report["env"]
    print(f"\n{model_desc}; {env['date']}; torch {env['torch']}, {env['threads']} threads, {env['cpu']}")
    print(f"pagedllm start-up (load + warm-up, not timed below): {startup:.2f} s\n")
    print(format_table(results))
    return report


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-") as tmp:
        dummy = args.model is None
        model_dir = write_dummy_model_dir(Path(tmp)) if dummy else Path(args.model)
        report = run(args, model_dir, dummy)
    line = json.dumps(report)
    print(line)
    if args.output_json:
        Path(args.output_json).write_text(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
