"""Decode-step linears streamed from 4 KiB pages against 2 MiB (transparent huge) pages, in one process.

    python -m benchmarks.huge_pages [--rounds 31] [--layers 30] [--methods int4 w4a8 fp32]

A SmolLM2-135M-shaped model's transformer linears (per layer qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536), packed as the engine packs them, are copied twice: into a mapping that
asks for huge pages (``host_memory.anonymous_pages``, as the CPU worker places a model's weights:
``weights_to_huge_pages``) and into one that does not.
Each round runs one batch-1 step's linears, in model order, from each copy (the order alternating
round by round) with each method's kernel; medians are reported with the ratio 4 KiB / huge. The
first stdout lines say how much of the process's memory the kernel gave in huge pages
(``AnonHugePages``: 0 means the kernel granted none and the comparison is void). The last stdout
line is the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.cpu_gemv import SHAPES
from pagedllm import cpu_info
from pagedllm.entrypoints.bench.common import environment
from pagedllm.layers.cpu_gemm_kernels import load_cpu_gemm, pack_group_params, pack_weight
from pagedllm.layers.cpu_kernels import kernel_build
from pagedllm.layers.quantization import int4
from pagedllm.worker.host_memory import anonymous_pages


class Arena:
    """Tensors copied one after another (64-byte aligned) into one fresh anonymous mapping."""

    def __init__(self, nbytes: int, huge: bool) -> None:
        self.pages = anonymous_pages(nbytes, huge)
        self.used = 0

    def put(self, t: torch.Tensor) -> torch.Tensor:
        start = -(-self.used // 64) * 64
        self.used = start + t.nbytes
        out = self.pages[start : self.used].view(t.dtype).view(t.shape)
        out.copy_(t)
        return out


def layer_tensors(method: str, w: torch.Tensor) -> list[torch.Tensor]:
    if method == "fp32":
        return [pack_weight(w)]
    q, scale, zero = int4.quantize_groupwise(w, 64)
    return [int4.pack_int4(q), *pack_group_params(scale, zero)]


def kernel(method: str) -> Callable[..., torch.Tensor]:
    if method == "fp32":
        op = load_cpu_gemm()
        return lambda x, packed: op(x, packed, None)
    op = int4.load_int4_gemm() if method == "int4" else int4.load_w4a8_gemm()
    return lambda x, packed, scale, zero: op(x, packed, scale, zero, None, 64)


def anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--methods", nargs="+", default=["int4", "w4a8", "fp32"], choices=["int4", "w4a8", "fp32"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(args.layers) for n, k in SHAPES.values()]
    xs = {k: torch.randn(1, k) for k in {576, 1536}}
    calls: dict[tuple[str, bool], list[tuple[int, list[torch.Tensor]]]] = {}
    before = anon_huge_kib()
    for method in args.methods:
        packed = [layer_tensors(method, w) for w in weights]
        nbytes = sum(-(-t.nbytes // 64) * 64 for ts in packed for t in ts)
        for huge in (False, True):
            arena = Arena(nbytes, huge)
            calls[method, huge] = [(w.shape[1], [arena.put(t) for t in ts]) for w, ts in zip(weights, packed)]
    print(
        f"{cpu_info.cpu_model()}, kernel build {kernel_build()}, {torch.get_num_threads()} threads; "
        f"AnonHugePages +{(anon_huge_kib() - before) / 1024:.0f} MiB for the huge copies"
    )
    samples: dict[tuple[str, bool], list[float]] = {key: [] for key in calls}
    for r in range(args.rounds + 1):
        for method in args.methods:
            run = kernel(method)
            for huge in (r % 2 == 0, r % 2 == 1):
                start = time.perf_counter()
                for k, tensors in calls[method, huge]:
                    run(xs[k], *tensors)
                if r:  # round 0 warms up
                    samples[method, huge].append(time.perf_counter() - start)
    report = {"env": environment(), "args": vars(args), "results": []}
    for method in args.methods:
        small, huge = (statistics.median(samples[method, h]) for h in (False, True))
        print(
            f"{method:5s}  4 KiB pages {small * 1e3:7.3f} ms   huge pages {huge * 1e3:7.3f} ms   4 KiB / huge {small / huge:.3f}x"
        )
        report["results"].append({"method": method, "small_pages_s": small, "huge_pages_s": huge})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
