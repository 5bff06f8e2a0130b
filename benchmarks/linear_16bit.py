"""A 16-bit model's CPU linears three ways, in one process: torch on the plain weight (oneDNN's own
bfloat16 / float16 GEMM), torch on a copy unpacked from the packed panels for each call (what
``PACKED_16_SPLIT`` runs from ``NATIVE_16_BIT_ROWS`` rows), and the packed kernel
(``packed_linear_16``).

    python -m benchmarks.linear_16bit [--dtype bfloat16] [--rows 1 8 16 32 64 128 512] [--layers 6]

Weights: SmolLM-135M's four linears per layer (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536) for ``--layers`` layers, random, in ``--dtype``. Each round times every method over all
of them in turn; medians of ``--rounds``. To see a CPU without native 16-bit dot products on one
that has them, hold oneDNN back: ``ONEDNN_MAX_CPU_ISA=AVX2 PAGEDLLM_CPU_ISA=avx2``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm.layers.cpu_gemm_kernels import load_cpu_gemm_16, pack_weight, unpack_weight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 512])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    kernel = load_cpu_gemm_16()
    if kernel is None:
        raise SystemExit("the packed 16-bit kernel is not available (PAGEDLLM_CPU_GEMM=0 or no build)")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = [torch.randn(n, k).to(dtype) for n, k in SHAPES * args.layers]
    packed = [pack_weight(w) for w in weights]
    methods = {
        "plain": lambda x, i: F.linear(x, weights[i]),
        "unpacked": lambda x, i: F.linear(x, unpack_weight(packed[i])),
        "packed": lambda x, i: kernel(x, packed[i], None),
    }
    print(
        f"{args.dtype}, {len(weights)} linears, {torch.get_num_threads()} threads; ms per pass, median of {args.rounds}"
    )
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in SHAPES}}
        for i, w in enumerate(weights):  # same results (within 16-bit rounding)
            ref = methods["plain"](xs[w.shape[1]], i).float()
            torch.testing.assert_close(methods["packed"](xs[w.shape[1]], i).float(), ref, rtol=2e-2, atol=2e-1)
        times: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.rounds):
            for name, run in methods.items():
                start = time.perf_counter()
                for i, w in enumerate(weights):
                    run(xs[w.shape[1]], i)
                times[name].append(time.perf_counter() - start)
        cells = "  ".join(f"{name} {statistics.median(t) * 1e3:8.2f}" for name, t in times.items())
        print(f"rows {rows:4d}: {cells}", flush=True)


if __name__ == "__main__":
    main()
