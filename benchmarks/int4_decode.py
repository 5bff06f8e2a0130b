"""Decode-step linears in fp32, int8, int4 and w4a8 on the same weights, with the int4 bandwidth floor.

    python -m benchmarks.int4_decode [--rows 1 4 8 16 64] [--reps 15] [--layers 30] [--group 64]
                                     [--threads N] [--quiet 0.1] [--baseline REV]

A SmolLM2-135M-shaped model's transformer linears (per layer qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536; the LM head is left out), called
in model order so each call streams its weight from memory as a decode step does. The three
formats run the engine's kernels on packed weights: fp32 (``packed_linear``), int8
(``packed_linear_int8``, per-channel scales) and int4 (``packed_linear_int4``, groups of
``--group`` inputs: 576 and 1536 are not multiples of 128, so the engine picks 64 here), and
w4a8 (``packed_linear_w4a8``: the int4 weights, activations quantized to int8 in the op).
Methods alternate each rep (as in ``benchmarks.cpu_gemv``) and medians are reported.
``--baseline REV`` adds ``int4@REV``, ``w4a8@REV`` and ``int8@REV``: those kernels' sources (and the headers) as of
git revision REV, built on its own at the engine's ISA level, in the same rotation on the same
weights, for a before / after comparison in one process. REV must share the packed layout
(blocks of 8 inputs per 32-bit word, from the commit that introduced w4a8 on).

The int4 floor: the bytes a step must read (packed nibbles + per-group scale and zero, float16
where exact as the engine packs them) over the machine's read bandwidth measured in the same run;
"of floor" is floor / measured time. ``int4/f32`` and ``w4a8/f32`` run the same kernels on float32
scales and zero points (the layout before float16 parameters; ``--baseline`` builds get those too).
The last stdout line is the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.cpu_gemv import SHAPES, wait_for_quiet
from benchmarks.kernel_revision import build_at_revision
from pagedllm import cpu_info
from pagedllm.entrypoints.bench.machine import measure_limits
from pagedllm.layers.cpu_gemm_kernels import load_cpu_gemm, pack_group_params, pack_groups, pack_weight
from pagedllm.layers.cpu_kernels import selected_isa
from pagedllm.layers.quantization import int4, int8

Call = Callable[[torch.Tensor], torch.Tensor]


def baseline_ops(rev: str) -> tuple[dict[str, int4.LinearInt4], dict[str, Callable[..., torch.Tensor]]]:
    """``packed_linear_int4`` and ``packed_linear_w4a8``, and ``packed_linear_int8``, built from git
    revision ``rev``'s sources (registered under their own op namespaces, beside the engine's
    build), by name."""
    grouped = build_at_revision(rev, "cpu_gemm_grouped.cpp", selected_isa())
    per_channel = build_at_revision(rev, "cpu_gemm_int8.cpp", selected_isa())
    int4_ops = {f"int4@{rev}": grouped.packed_linear_int4.default, f"w4a8@{rev}": grouped.packed_linear_w4a8.default}
    return int4_ops, {f"int8@{rev}": per_channel.packed_linear_int8.default}


def formats(
    w: torch.Tensor,
    group: int,
    extra_int4: dict[str, int4.LinearInt4],
    extra_int8: dict[str, Callable[..., torch.Tensor]],
) -> dict[str, tuple[Call, int]]:
    """Each format's call for weight ``w`` and the bytes it reads (``extra_int4`` / ``extra_int8``:
    more int4 / per-channel int8 kernels by name, on the same packed weights)."""
    fp32_op, int8_op, int4_op = load_cpu_gemm(), int8.load_int8_gemm(), int4.load_int4_gemm()
    w4a8_op = int4.load_w4a8_gemm()
    if fp32_op is None or int8_op is None or int4_op is None or w4a8_op is None:
        raise SystemExit("the CPU kernels did not build (or PAGEDLLM_CPU_KERNELS=0)")
    packed = pack_weight(w)
    q8, s8 = int8.quantize_and_pack(w)
    q, scale, zero = int4.quantize_groupwise(w, group)
    p4 = int4.pack_int4(q)
    # The engine's parameters (float16 where exact: pack_group_params) and float32 ones, which
    # the "/f32" rows and a --baseline revision (older builds take only float32) read.
    params = {"engine": pack_group_params(scale, zero), "f32": (pack_groups(scale), pack_groups(zero))}

    def int4_call(op: int4.LinearInt4, kind: str = "engine") -> tuple[Call, int]:
        s4, z4 = params[kind]
        assert z4 is not None, "int4 has zero points"
        return (lambda x: op(x, p4, s4, z4, None, group)), p4.nbytes + s4.nbytes + z4.nbytes

    return {
        "fp32": (lambda x: fp32_op(x, packed, None), packed.nbytes),
        "int8": (lambda x: int8_op(x, q8, s8, None), q8.nbytes + s8.nbytes),
        "int4": int4_call(int4_op),
        "w4a8": int4_call(w4a8_op),
        "int4/f32": int4_call(int4_op, "f32"),
        "w4a8/f32": int4_call(w4a8_op, "f32"),
        **{name: int4_call(op, "f32") for name, op in extra_int4.items()},
        **{name: ((lambda x, op=op: op(x, q8, s8, None)), q8.nbytes + s8.nbytes) for name, op in extra_int8.items()},
    }


def build(
    layers: int,
    group: int,
    seed: int,
    extra_int4: dict[str, int4.LinearInt4],
    extra_int8: dict[str, Callable[..., torch.Tensor]],
) -> list[tuple[int, dict[str, tuple[Call, int]]]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (k, formats(torch.randn(n, k, generator=gen) * 0.02, group, extra_int4, extra_int8))
        for _ in range(layers)
        for n, k in SHAPES.values()
    ]


def step_seconds(method: str, calls: list, xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for k, by_format in calls:
        by_format[method][0](xs[k])
    return time.perf_counter() - start


def bench_rows(rows: int, calls: list, reps: int, quiet: float) -> dict[str, float]:
    """Median seconds per step per format at ``rows`` rows, formats rotated each rep."""
    xs = {k: torch.randn(rows, k) for k in {576, 1536}}
    names = list(calls[0][1])
    samples: dict[str, list[float]] = {m: [] for m in names}
    for rep in range(reps + 1):
        wait_for_quiet(quiet)
        shift = rep % len(names)
        for method in names[shift:] + names[:shift]:
            seconds = step_seconds(method, calls, xs)
            if rep:  # rep 0 warms up
                samples[method].append(seconds)
    return {m: statistics.median(s) for m, s in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", type=float, default=0.1, help="start each rep once others use under this CPU share")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--baseline", metavar="REV", help="also time the int4, w4a8 and int8 kernels of this git revision")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    extra_int4, extra_int8 = baseline_ops(args.baseline) if args.baseline else ({}, {})
    limits = measure_limits(copy_mib=256)
    calls = build(args.layers, args.group, args.seed, extra_int4, extra_int8)
    nbytes = {m: sum(by_format[m][1] for _, by_format in calls) for m in ("fp32", "int8", "int4")}
    floor_s = nbytes["int4"] / (limits.read_gbps * 1e9)
    print(
        f"{cpu_info.cpu_model()}, threads {torch.get_num_threads()}, read {limits.read_gbps:.1f} GB/s; "
        f"weights per step: fp32 {nbytes['fp32'] / 1e6:.0f} MB, int8 {nbytes['int8'] / 1e6:.0f} MB, "
        f"int4 {nbytes['int4'] / 1e6:.0f} MB (int4 floor {floor_s * 1e3:.2f} ms)"
    )
    results = {}
    for rows in args.rows:
        med = bench_rows(rows, calls, args.reps, args.quiet)
        results[rows] = med
        floors = ", ".join(f"{m} {floor_s / t:.0%}" for m, t in med.items() if m.startswith(("int4", "w4a8")))
        print(
            f"M={rows:<4} "
            + " | ".join(f"{m} {t * 1e3:7.2f} ms x{med['fp32'] / t:4.2f}" for m, t in med.items())
            + f" | of the int4 bandwidth floor: {floors}"
        )
    print(json.dumps({"read_gbps": limits.read_gbps, "bytes": nbytes, "floor_s": floor_s, "median_s": results}))


if __name__ == "__main__":
    main()
