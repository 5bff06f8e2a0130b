"""Where a float32 GEMM call's cycles go, row tile by row tile, with its weight hot or cold.

    python -m benchmarks.gemm_tile_trace [--isa avx2] [--rows 16 64] [--shape 3072 576]
                                         [--calls 80] [--reps 3]

The working tree's ``csrc/cpu_gemm.cpp`` is built beside the engine's with ``PAGEDLLM_TILE_TRACE``
(``benchmarks.kernel_revision``; x86-64 only): each row tile over a panel group then adds its
``rdtsc`` cycles to a counter by row-tile index, the thread's first group of a call apart from the
rest. One weight of ``--shape`` (out, in) is called ``--calls`` times (hot: from cache after the
first) and ``--calls`` copies of it are called in turn (cold: each from memory, when the copies
exceed the last-level cache). Printed per row count and mode: microseconds a call and kcycles a
row tile, the first group's and the others'. Where the tiles that prefetch the next group run
slower than the rest, or a call's first group waits on memory, it shows here. Edit the kernel's
source and run again to see a change tile by tile. The last stdout line is the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch

from benchmarks.kernel_revision import build_at_revision
from pagedllm import cpu_info
from pagedllm.layers.cpu_gemm_kernels import pack_weight


def trace_mode(ops: Any, x: torch.Tensor, weights: list[torch.Tensor], reps: int) -> dict[str, Any]:
    """Median µs a call over ``reps`` passes over ``weights`` and the last pass's kcycles a row tile."""
    times = []
    for _ in range(reps):
        ops.packed_linear(x, weights[-1], None)
        ops.tile_trace(x)  # drop the counts so far
        start = time.perf_counter()
        for w in weights:
            ops.packed_linear(x, w, None)
        times.append((time.perf_counter() - start) / len(weights))
        trace = ops.tile_trace(x)
    tiles = (x.shape[0] + 5) // 6
    per_tile = trace[0] / trace[1].clamp(min=1) / 1e3
    return {
        "us_per_call": statistics.median(times) * 1e6,
        "first_group_kcycles": [round(v, 1) for v in per_tile[0][:tiles].tolist()],
        "other_groups_kcycles": [round(v, 1) for v in per_tile[1][:tiles].tolist()],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isa", default="avx2", help="kernel build level (default avx2)")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    p.add_argument("--shape", type=int, nargs=2, default=[3072, 576], metavar=("OUT", "IN"))
    p.add_argument("--calls", type=int, default=80, help="calls per pass; copies of the weight when cold")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    if platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit("the tile trace reads the x86 time-stamp counter: x86-64 only")
    ops = build_at_revision(None, "cpu_gemm.cpp", args.isa, defines=("PAGEDLLM_TILE_TRACE",))
    n, k = args.shape
    gen = torch.Generator().manual_seed(0)
    copies = [pack_weight(torch.randn(n, k, generator=gen) * 0.02) for _ in range(args.calls)]
    print(
        f"{cpu_info.cpu_model()}, {args.isa} build, {torch.get_num_threads()} threads, weight {n} x {k} "
        f"({n * k * 4 / 2**20:.1f} MiB, {args.calls} copies cold); kcycles a row tile over a 4-panel group"
    )
    report = []
    for rows in args.rows:
        x = torch.randn(rows, k, generator=gen)
        for mode, weights in (("hot", [copies[0]] * args.calls), ("cold", copies)):
            r = {"rows": rows, "mode": mode, **trace_mode(ops, x, weights, args.reps)}
            report.append(r)
            print(
                f"rows {rows:4d} {mode:4s} {r['us_per_call']:9.1f} us a call | first group: "
                + " ".join(f"{v:5.1f}" for v in r["first_group_kcycles"])
                + " | other groups: "
                + " ".join(f"{v:5.1f}" for v in r["other_groups_kcycles"])
            )
    print(json.dumps({"isa": args.isa, "shape": [n, k], "calls": args.calls, "results": report}))


if __name__ == "__main__":
    main()
