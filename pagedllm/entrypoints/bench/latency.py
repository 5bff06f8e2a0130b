"""``pagedllm bench latency``: prefill time of one long prompt and decode step time at several
batch sizes, each against the machine's floor measured in the same run, plus engine overhead.

The engine is driven directly (``LLMEngine``): add a batch of short-prompt requests, step until
each has its first token, run warm-up steps, then time each of K pure decode steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from pagedllm.config.choices import canonical_dtype
from pagedllm.entrypoints.bench import common, llama_cpp, machine
from pagedllm.entrypoints.bench.engine_probe import EngineProbe


@dataclass
class Measurement:
    """One figure of one system: ``batch`` sequences (decode) or one ``prompt_len`` prefill."""

    system: str
    figure: str  # "decode" or "prefill"
    batch: int
    tokens: int  # tokens per timed unit: batch (decode) or prompt_len (prefill)
    seconds: float  # median seconds per step (decode) or per prefill
    bytes: int
    flops: int
    floor_s: float
    core_s: float | None = None  # pagedllm: EngineCore.step
    model_s: float | None = None  # pagedllm: forward + LM head inside it
    weights: str = ""  # what the system computes with, e.g. "int4, head int8 g32" or "Q4_0, head Q8_0"
    own_floor_s: float | None = None  # pagedllm decode: the floor from the bytes its weights are held in

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            tokens_per_s=self.tokens / self.seconds,
            gbps=self.bytes / self.seconds / 1e9,
            gflops=self.flops / self.seconds / 1e9,
            floor_tokens_per_s=self.tokens / self.floor_s,
            x_floor=self.floor_s / self.seconds,
            x_own_floor=None if self.own_floor_s is None else self.own_floor_s / self.seconds,
            engine_overhead=self.overhead(),
        )
        return out

    def overhead(self) -> float | None:
        if not self.core_s or not self.model_s:
            return None
        return max(0.0, 1.0 - self.model_s / self.core_s)


def add_args(p: argparse.ArgumentParser) -> None:
    common.add_common_args(p)
    common.add_engine_args(p, max_num_seqs=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--decode-prompt-len", type=int, default=32, help="prompt tokens of each decode sequence")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed decode steps before timing")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per batch size")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--prefill-iters", type=int, default=3, help="timed prefills (median), after one warm-up")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="pagedllm's sampling temperature (0: greedy, the default; vLLM's latency benchmark samples at 1.0). "
        "The llama.cpp and HF baselines time their forward passes only",
    )
    common.add_limits_args(p)
    p.add_argument("--hf-baseline", action="store_true", help="also time a plain HF forward loop")
    p.add_argument("--llama-cpp-baseline", action="store_true", help="also time llama.cpp (llama-cpp-python)")
    llama_cpp.add_gguf_args(p)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every system this many times, alternating (pagedllm, baselines, pagedllm, ...), and report "
        "each figure's median: on a machine whose speed drifts, systems timed minutes apart are not comparable",
    )


# ---------------------------------------------------------------------------------------------- pagedllm
def _decode_tokens(args: argparse.Namespace, batch: int) -> int:
    """max_tokens of a decode request: the warm-up and timed steps, plus the steps that the batch's
    later prompts take to prefill (in chunks of at least the default 2048-token budget), during
    which the first requests already decode; none may finish before the timing ends."""
    prefill_steps = -(-batch * args.decode_prompt_len // (args.max_num_batched_tokens or 2048)) + 1
    return args.warmup_steps + args.decode_steps + 4 + prefill_steps


def _make_engine(args: argparse.Namespace, model: common.BenchModel, cost: machine.ModelCost) -> Any:
    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    decode_ctx = args.decode_prompt_len + _decode_tokens(args, max(args.batch_sizes)) + 4
    max_len = max(args.prefill_len, decode_ctx) + 16
    tokens = max(args.prefill_len, max(args.batch_sizes) * decode_ctx) + 64 * 16
    overrides: dict[str, Any] = dict(
        enable_prefix_caching=False,
        max_num_seqs=max(args.batch_sizes),
        max_model_len=args.max_model_len or max_len,
        max_num_batched_tokens=max(args.max_num_batched_tokens or 2048, max_len),
    )
    if args.kv_cache_memory is None:
        overrides["kv_cache_memory"] = max(1.25 * tokens * cost.kv_bytes_per_token / 2**30, 0.0625)
    return LLMEngine.from_engine_args(EngineArgs(**common.engine_kwargs(args, model, **overrides)))


def _add(engine: Any, rng: random.Random, vocab: int, prompt_len: int, max_tokens: int, temperature: float) -> str:
    from pagedllm.sampling_params import SamplingParams

    rid = engine.next_request_id()
    prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    return rid


def step_until_first_tokens(engine: Any, ids: list[str]) -> None:
    """Step ``engine`` until every request in ``ids`` has its first token (prefill done)."""
    pending = set(ids)
    while pending:
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                pending.discard(out.request_id)


def measure_decode(
    engine: Any,
    probe: EngineProbe,
    args: argparse.Namespace,
    batch: int,
    cost: machine.ModelCost,
    limits: machine.MachineLimits,
    rng: random.Random,
    vocab: int,
) -> Measurement:
    total = _decode_tokens(args, batch)
    ids = [_add(engine, rng, vocab, args.decode_prompt_len, total, args.temperature) for _ in range(batch)]
    step_until_first_tokens(engine, ids)
    for _ in range(args.warmup_steps):
        engine.step()
    steps, core, model = [], [], []
    for _ in range(args.decode_steps):
        probe.reset()
        start = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - start)
        core.append(probe.core.seconds)
        model.append(probe.model.seconds)
        if len(outs) != batch:
            raise RuntimeError(f"a decode step returned {len(outs)} outputs for a batch of {batch}")
    engine.abort_request(ids)
    ctx = args.decode_prompt_len + 1 + args.warmup_steps + args.decode_steps // 2
    nbytes, flops = machine.decode_cost(cost, [ctx] * batch)
    held = machine.held_step_bytes(probe.weights_model) + nbytes - cost.weight_bytes  # + the KV cache read
    return Measurement(
        "pagedllm",
        "decode",
        batch,
        batch,
        statistics.median(steps),
        nbytes,
        flops,
        machine.floor_seconds(limits, nbytes, flops),
        statistics.median(core),
        statistics.median(model) if probe.model.calls else None,
        own_floor_s=machine.floor_seconds(limits, held, flops),
    )


def measure_prefill(
    engine: Any,
    probe: EngineProbe,
    args: argparse.Namespace,
    cost: machine.ModelCost,
    limits: machine.MachineLimits,
    rng: random.Random,
    vocab: int,
) -> Measurement:
    times, core, model = [], 0.0, 0.0
    for i in range(args.prefill_iters + 1):
        _add(engine, rng, vocab, args.prefill_len, 1, args.temperature)
        probe.reset()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - start)
            core, model = core + probe.core.seconds, model + probe.model.seconds
    n = args.prefill_iters
    flops = machine.prefill_flops(cost, args.prefill_len)
    nbytes = cost.weight_bytes + cost.kv_bytes_per_token * args.prefill_len
    return Measurement(
        "pagedllm",
        "prefill",
        1,
        args.prefill_len,
        statistics.median(times),
        nbytes,
        flops,
        machine.floor_seconds(limits, nbytes, flops),
        core / n,
        model / n,
    )


def run_pagedllm(
    args: argparse.Namespace,
    model: common.BenchModel,
    cost: machine.ModelCost,
    limits: machine.MachineLimits,
    vocab: int,
) -> list[Measurement]:
    engine = _make_engine(args, model, cost)
    probe = EngineProbe(engine, args.device)
    rng = random.Random(args.seed)
    results = [measure_prefill(engine, probe, args, cost, limits, rng, vocab)]
    for batch in args.batch_sizes:
        results.append(measure_decode(engine, probe, args, batch, cost, limits, rng, vocab))
    weights = pagedllm_weights(args, probe.weights_model, engine.config.model_config.quantization)
    del engine, probe
    gc.collect()
    return [dataclasses.replace(m, weights=weights) for m in results]


def pagedllm_weights(args: argparse.Namespace, model: Any, quantization: str | None = None) -> str:
    """What pagedllm computes with, for the tables: the method (``quantization``: as the engine
    resolved it, e.g. a GGUF file's default) and its LM head's form (as built)."""
    from pagedllm.layers.quantization.int8_groups import GroupedInt8HeadMethod
    from pagedllm.layers.quantization.w8a8 import W8A8LinearMethod

    dtype = canonical_dtype(args.dtype)
    quantization = quantization or args.quantization
    if quantization in (None, "none"):
        return dtype
    head = getattr(getattr(model, "lm_head", None), "quant_method", None)
    forms = ((GroupedInt8HeadMethod, "int8 g32"), (W8A8LinearMethod, "w8a8"))
    form = next((name for cls, name in forms if isinstance(head, cls)), dtype)
    return f"{quantization}, head {form}"


# ---------------------------------------------------------------------------------------------- baselines
def baseline_measurement(
    system: str,
    figure: str,
    batch: int,
    tokens: int,
    seconds: float,
    ctx: int,
    cost: machine.ModelCost,
    limits: machine.MachineLimits,
) -> Measurement:
    if figure == "prefill":
        nbytes, flops = cost.weight_bytes + cost.kv_bytes_per_token * tokens, machine.prefill_flops(cost, tokens)
    else:
        nbytes, flops = machine.decode_cost(cost, [ctx] * batch)
    return Measurement(
        system, figure, batch, tokens, seconds, nbytes, flops, machine.floor_seconds(limits, nbytes, flops)
    )


def run_hf(
    args: argparse.Namespace,
    model: common.BenchModel,
    cost: machine.ModelCost,
    limits: machine.MachineLimits,
    vocab: int,
) -> list[Measurement]:
    from pagedllm.entrypoints.bench import baselines

    hf = baselines.load_hf_model(model.path, model.dummy, args.seed).to(args.device if args.device != "auto" else "cpu")
    secs = baselines.prefill_seconds(hf, args.prefill_len, args.prefill_iters, vocab, args.seed)
    out = [baseline_measurement("hf", "prefill", 1, args.prefill_len, secs, 0, cost, limits)]
    ctx = args.decode_prompt_len + 1 + args.warmup_steps + args.decode_steps // 2
    for batch in args.batch_sizes:
        times = baselines.decode_step_seconds(
            hf, batch, args.decode_prompt_len, args.warmup_steps, args.decode_steps, vocab, args.seed
        )
        out.append(baseline_measurement("hf", "decode", batch, batch, statistics.median(times), ctx, cost, limits))
    del hf
    gc.collect()
    return [dataclasses.replace(m, weights=canonical_dtype(args.dtype)) for m in out]


def run_llama_cpp(
    args: argparse.Namespace,
    model: common.BenchModel,
    cost: machine.ModelCost,
    limits: machine.MachineLimits,
    vocab: int,
) -> tuple[list[Measurement], str]:
    if not llama_cpp.available():
        return [], llama_cpp.unavailable_reason()
    with llama_cpp.gguf_for(model, args.seed, args) as gguf_path:
        timings = llama_cpp.latency(gguf_path, args, vocab)
    ctx = args.decode_prompt_len + 1 + args.warmup_steps + args.decode_steps // 2
    out = [baseline_measurement("llama.cpp", "prefill", 1, args.prefill_len, timings.prefill_s, 0, cost, limits)]
    out += [
        baseline_measurement("llama.cpp", "decode", b, b, s, ctx, cost, limits)
        for b, s in sorted(timings.decode_s.items())
    ]
    return [dataclasses.replace(m, weights=llama_cpp.weights_label(args)) for m in out], timings.note


# ---------------------------------------------------------------------------------------------- report
def format_results(results: list[Measurement]) -> str:
    header = (
        "system",
        "weights",
        "figure",
        "batch",
        "ms",
        "tok/s",
        "GB/s",
        "GFLOP/s",
        "floor tok/s",
        "x floor",
        "x own floor",
        "overhead",
    )
    rows = []
    for m in results:
        d = m.to_dict()
        ovh = d["engine_overhead"]
        rows.append(
            (
                m.system,
                m.weights or "-",
                m.figure if m.figure == "decode" else f"prefill {m.tokens}",
                m.batch,
                m.seconds * 1e3,
                d["tokens_per_s"],
                d["gbps"],
                d["gflops"],
                d["floor_tokens_per_s"],
                d["x_floor"],
                d["x_own_floor"],
                None if ovh is None else f"{100 * ovh:.1f}%",
            )
        )
    return common.format_table(header, rows)


def run_round(
    args: argparse.Namespace,
    model: common.BenchModel,
    cost: machine.ModelCost,
    limits: machine.MachineLimits,
    vocab: int,
) -> tuple[list[Measurement], list[str]]:
    """Every system once, one after another: (measurements, notes)."""
    results = run_pagedllm(args, model, cost, limits, vocab)
    notes = []
    if args.hf_baseline:
        results += run_hf(args, model, cost, limits, vocab)
    if args.llama_cpp_baseline:
        llama, note = run_llama_cpp(args, model, cost, limits, vocab)
        results += llama
        notes.append(f"llama.cpp: {note}")
    return results, notes


def median_over_rounds(rounds: list[list[Measurement]]) -> list[Measurement]:
    """Per (system, figure, batch), the measurement whose time is the median over the rounds (the
    lower middle one for an even count), so its engine timings belong to the same run."""
    by_key: dict[tuple[str, str, int], list[Measurement]] = {}
    for measurements in rounds:
        for m in measurements:
            by_key.setdefault((m.system, m.figure, m.batch), []).append(m)
    return [sorted(ms, key=lambda m: m.seconds)[(len(ms) - 1) // 2] for ms in by_key.values()]


def run(args: argparse.Namespace) -> dict[str, Any]:
    if min(args.batch_sizes) < 1 or args.decode_steps < 1 or args.prefill_iters < 1 or args.rounds < 1:
        raise ValueError("--batch-sizes, --decode-steps, --prefill-iters and --rounds must be >= 1")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 is greedy); got {args.temperature}")
    env = common.environment()
    with common.bench_model(args) as model:
        vocab, _ = common.model_limits(model.path)
        cost = machine.model_cost(common.read_hf_config(model.path), args.dtype, args.kv_cache_dtype)
        limits = common.measure_limits(args)
        rounds: list[list[Measurement]] = []
        notes: list[str] = []
        for _ in range(args.rounds):
            measurements, notes = run_round(args, model, cost, limits, vocab)
            rounds.append(measurements)
        results = median_over_rounds(rounds)
    if args.rounds > 1:
        notes.append(f"each figure: the median of {args.rounds} rounds, the systems alternating")
    sampling = "greedy" if args.temperature == 0 else f"pagedllm samples at temperature {args.temperature:g}"
    print(f"\n{model.desc}, {sampling}; {common.env_line(env)}\n{machine.describe(limits, cost)}\n")
    print(format_results(results))
    for note in notes:
        print(f"  {note}")
    return {
        "benchmark": "latency",
        "model": model.desc,
        "env": env,
        "args": common.args_dict(args),
        "machine": limits.to_dict(),
        "model_cost": {**asdict(cost), "weight_bytes": cost.weight_bytes, "params": cost.params},
        "results": [m.to_dict() for m in results],
        "notes": notes,
    }
