"""``pagedllm bench throughput``: offline throughput of N seeded requests (random or shared-prefix
dataset, exact output lengths with EOS ignored) in ONE ``LLM.generate`` call, next to baselines
on the same requests: Hugging Face ``generate`` one at a time and in padded batches, and llama.cpp
with continuous batching over a fixed number of slots (like ``llama-server -np N``).
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import asdict, dataclass
from typing import Any

from pagedllm.entrypoints.bench import common, llama_cpp
from pagedllm.entrypoints.bench.datasets import BenchRequest, total_prompt_tokens


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
        return {
            "requests_per_s": self.requests / self.elapsed_s,
            "output_tokens_per_s": self.output_tokens / self.elapsed_s,
            "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / self.elapsed_s,
        }

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), **self.rates()}


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p)
    common.add_engine_args(p)
    common.add_dataset_args(p)
    p.add_argument("--disable-detokenize", action="store_true", help="pagedllm: skip detokenizing outputs")
    p.add_argument(
        "--floor",
        action="store_true",
        help="measure the machine's limits and add the workload's floor (all requests at once: "
        "prefill at the GEMM rate, each decode step at its roofline)",
    )
    common.add_limits_args(p)
    g = p.add_argument_group("baselines (same requests, same process, one after another)")
    g.add_argument("--hf-baseline", action="store_true", help="run HF generate one at a time and in padded batches")
    g.add_argument(
        "--hf-one-at-a-time-requests",
        type=int,
        default=None,
        metavar="K",
        help="HF one-at-a-time on the first K requests only (0: skip; default: all)",
    )
    g.add_argument(
        "--hf-batch-requests",
        type=int,
        default=None,
        metavar="K",
        help="HF padded batches on the first K requests only (0: skip; default: all)",
    )
    g.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16], metavar="B")
    g.add_argument("--llama-cpp-baseline", action="store_true", help="run llama.cpp (llama-cpp-python)")
    g.add_argument(
        "--llama-cpp-slots",
        type=int,
        nargs="+",
        default=[16],
        metavar="N",
        help="parallel sequences of llama.cpp's continuous batching (default 16)",
    )
    g.add_argument(
        "--llama-cpp-requests",
        type=int,
        default=None,
        metavar="K",
        help="llama.cpp on the first K requests only (default: all)",
    )
    llama_cpp.add_gguf_args(g)


# ---------------------------------------------------------------------------------------------- pagedllm
def run_pagedllm(
    args: argparse.Namespace, model: common.BenchModel, requests: list[BenchRequest]
) -> tuple[SystemResult, float]:
    """(result of ONE timed generate over all requests, start-up seconds incl. a short warm-up)."""
    from pagedllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(**common.engine_kwargs(args, model))
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(10, 26))}], warm, use_tqdm=False)
    startup = time.perf_counter() - start
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=r.output_len, ignore_eos=True, detokenize=not args.disable_detokenize
        )
        for r in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    cached = sum(o.num_cached_tokens for o in outputs)
    del llm, outputs
    gc.collect()
    _check_lengths(generated, requests)
    weights = f"--quantization {args.quantization}" if args.quantization else args.dtype
    note = f"one LLM.generate call, continuous batching, {weights}; {cached} prompt tokens from the prefix cache"
    return SystemResult(
        "pagedllm", len(requests), total_prompt_tokens(requests), sum(generated), sum(generated), elapsed, note
    ), startup


def _check_lengths(generated: list[int], requests: list[BenchRequest]) -> None:
    wrong = [(i, g, r.output_len) for i, (g, r) in enumerate(zip(generated, requests)) if g != r.output_len]
    if wrong:
        raise RuntimeError(
            f"pagedllm generated the wrong number of tokens for {len(wrong)} requests "
            f"(index, got, expected): {wrong[:5]}"
        )


# ---------------------------------------------------------------------------------------------- baselines
def subset(requests: list[BenchRequest], k: int | None) -> list[BenchRequest]:
    if k is None:
        return requests
    if k < 0:
        raise ValueError(f"a request count must be >= 0, got {k}")
    return requests[:k]


def _result(
    system: str, sub: list[BenchRequest], total: int, useful: int, generated: int, elapsed: float, note: str
) -> SystemResult:
    if len(sub) < total:
        note += f"; SUBSET: first {len(sub)} of {total} requests"
    return SystemResult(system, len(sub), total_prompt_tokens(sub), useful, generated, elapsed, note)


def run_hf(args: argparse.Namespace, model: common.BenchModel, requests: list[BenchRequest]) -> list[SystemResult]:
    from pagedllm.entrypoints.bench import baselines

    single = subset(requests, args.hf_one_at_a_time_requests)
    batched = subset(requests, args.hf_batch_requests)
    if not single and not batched:
        return []
    hf = baselines.load_hf_model(model.path, model.dummy, args.seed).to("cpu" if args.device == "auto" else args.device)
    baselines.warm_up(hf)
    results = []
    if single:
        run = baselines.run_one_at_a_time(hf, single)
        results.append(
            _result(
                "hf-one-at-a-time",
                single,
                len(requests),
                run.useful_output_tokens,
                run.generated_tokens,
                run.elapsed_s,
                "batch size 1",
            )
        )
    for size in args.hf_batch_sizes if batched else []:
        run = baselines.run_padded_batches(hf, batched, size)
        results.append(
            _result(
                f"hf-batch-{size}",
                batched,
                len(requests),
                run.useful_output_tokens,
                run.generated_tokens,
                run.elapsed_s,
                f"left-padded batches of {size}, dataset order",
            )
        )
    del hf
    gc.collect()
    return results


def run_llama_cpp(
    args: argparse.Namespace, model: common.BenchModel, requests: list[BenchRequest]
) -> tuple[list[SystemResult], str]:
    if not llama_cpp.available():
        return [], llama_cpp.unavailable_reason()
    sub = subset(requests, args.llama_cpp_requests)
    results = []
    weights = llama_cpp.weights_label(args)
    with llama_cpp.gguf_for(model, args.seed, args) as path:
        for slots in args.llama_cpp_slots:
            elapsed = llama_cpp.continuous_batching(path, sub, slots)
            useful = sum(r.output_len for r in sub)
            results.append(
                _result(
                    f"llama.cpp-{slots}-slots",
                    sub,
                    len(requests),
                    useful,
                    useful,
                    elapsed,
                    f"continuous batching over {slots} sequences, {weights} GGUF",
                )
            )
    return results, (
        f"{weights} GGUF, default KV type (f16), llama_batch with one sequence per slot; fed token ids are not sampled; "
        f"built for {llama_cpp.build_label()}"
    )


def floor_result(args: argparse.Namespace, model: common.BenchModel, requests: list[BenchRequest]) -> SystemResult:
    from pagedllm.entrypoints.bench import machine

    limits = common.measure_limits(args)
    cost = machine.model_cost(common.read_hf_config(model.path), args.dtype, args.kv_cache_dtype)
    seconds = machine.workload_floor_seconds(
        cost, limits, [len(r.prompt_token_ids) for r in requests], [r.output_len for r in requests]
    )
    useful = sum(r.output_len for r in requests)
    return SystemResult(
        "floor", len(requests), total_prompt_tokens(requests), useful, useful, seconds, machine.describe(limits, cost)
    )


# ---------------------------------------------------------------------------------------------- report
def _ratio(paged: SystemResult, other: SystemResult) -> float:
    return paged.rates()["output_tokens_per_s"] / other.rates()["output_tokens_per_s"]


def format_results(results: list[SystemResult]) -> str:
    paged = results[0]
    header = ("system", "reqs", "prompt tok", "output tok", "wall s", "req/s", "out tok/s", "total tok/s", "pagedllm x")
    rows = [
        (
            r.system,
            r.requests,
            r.prompt_tokens,
            r.output_tokens,
            r.elapsed_s,
            r.rates()["requests_per_s"],
            r.rates()["output_tokens_per_s"],
            r.rates()["total_tokens_per_s"],
            None if r is paged else _ratio(paged, r),
        )
        for r in results
    ]
    notes = [f"  {r.system}: {r.note}" for r in results if r.note]
    return "\n".join([common.format_table(header, rows), *notes])


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = common.environment()
    notes = []
    with common.bench_model(args) as model:
        requests = common.make_requests(args, *common.model_limits(model.path))
        paged, startup = run_pagedllm(args, model, requests)
        results = [paged]
        if args.floor:
            results.append(floor_result(args, model, requests))
        if args.hf_baseline:
            results += run_hf(args, model, requests)
        if args.llama_cpp_baseline:
            llama, status = run_llama_cpp(args, model, requests)
            results += llama
            notes.append(f"llama.cpp: {status}")
    print(f"\n{model.desc}; {common.env_line(env)}")
    print(f"pagedllm start-up (load + warm-up, not timed below): {startup:.2f} s\n")
    print(format_results(results))
    for note in notes:
        print(f"  {note}")
    return {
        "benchmark": "throughput",
        "model": model.desc,
        "env": env,
        "args": common.args_dict(args),
        "pagedllm_startup_s": startup,
        "results": [r.to_dict() for r in results],
        "notes": notes,
        "pagedllm_output_tok_s_ratio": {r.system: _ratio(paged, r) for r in results[1:]},
    }
