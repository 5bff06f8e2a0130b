"""CPU linear layers at decode batch sizes: the packed-weight kernel vs oneDNN vs ``F.linear``.

    python -m benchmarks.cpu_gemv [--rows 1 2 4 8 16 32 64 128] [--reps 15] [--layers 30]
                                  [--isa avx512 avx2] [--baseline REV]

Weights are a SmolLM-135M-shaped model's (per layer qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536; LM head 49152x576), 538 MB in all, called in model order so every call streams
its weight from memory as a real decode step does. Each rep runs one whole "step" per method,
the methods alternating (A B C, B C A, ...) so the machine's noise hits all alike; the table shows
medians over reps, the weight GB/s and GFLOP/s they imply, and each method's ratio to oneDNN
and to ``F.linear`` per shape. The packed kernel runs once per ``--isa`` level (``packed-avx2``,
...; default: the engine's level), all on the same packed weights (the layout is ISA-independent).
``--baseline REV`` adds ``packed-<level>@REV``: the kernel's source as of git revision REV, built
beside the engine's (``benchmarks.kernel_revision``), for a before / after in one process.
Each rep waits (up to 2 min) until other processes leave the CPUs idle, see ``--quiet``.
The machine's copy and read bandwidth are measured in the same run for reference. The last
stdout line is the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.kernel_revision import build_at_revision
from pagedllm import cpu_info
from pagedllm.entrypoints.bench.machine import measure_limits
from pagedllm.layers.cpu_gemm_kernels import pack_weight
from pagedllm.layers.cpu_kernels import cpu_ops, selected_isa

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def layouts(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The weight as each method stores it."""
    return {"onednn": torch.ops.mkldnn._reorder_linear_weight(w, 16), "flinear": w, "packed": pack_weight(w)}


BASELINES: dict[str, Linear] = {
    "onednn": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
    "flinear": lambda x, w: F.linear(x, w),
}


def packed_methods(levels: list[str], baseline: str | None = None) -> dict[str, Linear]:
    """``packed-<level>``: the packed kernel of each ISA level's build; with ``baseline``, also
    ``packed-<level>@<baseline>``: that git revision's kernel source, built beside it."""
    methods: dict[str, Linear] = {}
    for level in levels:
        ops = cpu_ops(level)
        if ops is None:
            raise SystemExit(f"the {level} kernel build failed (or PAGEDLLM_CPU_KERNELS=0)")
        methods[f"packed-{level}"] = lambda x, w, op=ops.packed_linear.default: op(x, w, None)
        if baseline:
            old = build_at_revision(baseline, "cpu_gemm.cpp", level).packed_linear.default
            methods[f"packed-{level}@{baseline}"] = lambda x, w, op=old: op(x, w, None)
    return methods


def build(layers: int, seed: int) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """(shape name, in features, weight per method) in model order: layer by layer, then the LM head."""
    gen = torch.Generator().manual_seed(seed)
    calls = []
    for _ in range(layers):
        for name, (n, k) in SHAPES.items():
            calls.append((name, k, layouts(torch.randn(n, k, generator=gen) * 0.02)))
    calls.append(("lm_head", LM_HEAD[1], layouts(torch.randn(*LM_HEAD, generator=gen) * 0.02)))
    return calls


def run_step(method: str, fn: Linear, calls: list, xs: dict[int, torch.Tensor]) -> dict[str, float]:
    """Seconds per shape name for one step of ``method``."""
    spent: dict[str, float] = {}
    for name, k, weights in calls:
        x, w = xs[k], weights[method.split("-")[0]]
        start = time.perf_counter()
        fn(x, w)
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
    return spent


def _cpu_ticks() -> tuple[int, int]:
    """(all, idle + iowait) CPU ticks since boot, from Linux /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]


def busy_fraction(seconds: float = 0.2) -> float:
    """Share of all CPUs busy over ``seconds`` (0.0 where /proc/stat is missing)."""
    if not os.path.exists("/proc/stat"):
        return 0.0
    total0, idle0 = _cpu_ticks()
    time.sleep(seconds)
    total1, idle1 = _cpu_ticks()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_for_quiet(threshold: float, timeout: float = 120.0) -> None:
    """On a shared machine another process on "our" cores stalls every OpenMP barrier for a
    scheduler slice (a 2-thread GEMV then takes 10x longer): start each rep when others are idle."""
    deadline = time.monotonic() + timeout
    while threshold < 1.0 and time.monotonic() < deadline and busy_fraction() > threshold:
        pass


def bench_rows(
    rows: int, calls: list, reps: int, methods: dict[str, Linear], quiet: float
) -> dict[str, dict[str, float]]:
    """Median seconds per shape (and "step") per method at ``rows`` rows, methods interleaved."""
    xs = {k: torch.randn(rows, k) for k in {576, 1536}}
    names = list(methods)
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in names}
    for rep in range(reps + 1):
        wait_for_quiet(quiet)
        for method in names[rep % len(names) :] + names[: rep % len(names)]:  # rotate who goes first
            spent = run_step(method, methods[method], calls, xs)
            if rep:  # rep 0 warms up (first touch, kernel selection)
                samples[method].append({**spent, "step": sum(spent.values())})
    return {m: {name: statistics.median(s[name] for s in runs) for name in runs[0]} for m, runs in samples.items()}


def weight_bytes(calls: list) -> dict[str, int]:
    nbytes: dict[str, int] = {}
    for name, _, weights in calls:
        nbytes[name] = nbytes.get(name, 0) + weights["flinear"].numel() * 4
    nbytes["step"] = sum(nbytes.values())
    return nbytes


def report_rows(rows: int, med: dict[str, dict[str, float]], nbytes: dict[str, int]) -> None:
    """One line per shape: each method's median, the weight GB/s and GFLOP/s it implies, and its
    speed relative to oneDNN (xR) and to F.linear (xF), where those ran."""
    for name in [*SHAPES, "lm_head", "step"]:
        flops = 2 * rows * nbytes[name] / 4
        cells = []
        for m in med:
            t = med[m][name]
            ratios = "".join(
                f" {tag}{med[b][name] / t:4.2f}" for b, tag in (("onednn", "xR"), ("flinear", "xF")) if b in med
            )
            cells.append(
                f"{m} {t * 1e3:7.2f} ms {nbytes[name] / t / 1e9:5.1f} GB/s {flops / t / 1e9:5.0f} GF/s{ratios}"
            )
        print(f"M={rows:<4} {name:8} " + " | ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--baselines", nargs="*", default=list(BASELINES), choices=list(BASELINES))
    p.add_argument(
        "--isa",
        nargs="*",
        default=None,
        choices=cpu_info.runnable_isas(),
        help="ISA levels whose packed kernel to time (default: the engine's, PAGEDLLM_CPU_ISA; none: baselines only)",
    )
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="also time each --isa level's packed kernel as of this git revision (same packed layout)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quiet",
        type=float,
        default=0.1,
        help="start each rep once other processes use under this share of the CPUs (1 = never wait)",
    )
    args = p.parse_args()
    levels = [selected_isa()] if args.isa is None else args.isa
    methods = {**{b: BASELINES[b] for b in args.baselines}, **packed_methods(levels, args.baseline)}
    if not methods:
        raise SystemExit("nothing to time: give --baselines or --isa")
    limits = measure_limits(copy_mib=256)
    print(
        f"{cpu_info.cpu_model()}, threads {torch.get_num_threads()}, copy {limits.copy_gbps:.1f} GB/s, "
        f"read {limits.read_gbps:.1f} GB/s; xR = oneDNN time / method time, xF = F.linear time / method time"
    )
    calls = build(args.layers, args.seed)
    nbytes = weight_bytes(calls)
    results = {}
    for rows in args.rows:
        med = bench_rows(rows, calls, args.reps, methods, args.quiet)
        report_rows(rows, med, nbytes)
        results[rows] = med
    print(
        json.dumps({"copy_gbps": limits.copy_gbps, "read_gbps": limits.read_gbps, "bytes": nbytes, "median_s": results})
    )


if __name__ == "__main__":
    main()
