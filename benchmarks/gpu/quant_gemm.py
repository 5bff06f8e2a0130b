"""The Triton int8 / int4 dequant-GEMMs on a GPU: checked against torch's dequantize-then-matmul
and timed against it (and against the bf16 GEMM on the float weight), at Llama-3-8B's linear
shapes and M from decode to prefill. Run by ``run_h200.sh`` (step ``quant_gemm``) or alone:

    python benchmarks/gpu/quant_gemm.py --json quant_gemm.json [--sweep]

Per (format, shape, M): the max error relative to the output's max |y| against the float64
reference, and CUDA-event medians of the Triton kernel, of torch dequantizing the weight to bf16
then ``F.linear`` (what a layer without a fused kernel does), and of ``F.linear`` on a bf16 weight
held as is (the unquantized path); the kernel's achieved weight bandwidth. ``--sweep`` also times
each tile of ``TILES`` (and a few narrower ones) at every M, to tune the table by measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from h200_tools import _event_times  # noqa: E402  (this script's folder is on sys.path)

from pagedllm.layers.quantization import int4, triton_layout  # noqa: E402
from pagedllm.layers.quantization.int8 import quantize_per_channel  # noqa: E402
from pagedllm.layers.quantization.triton_dequant_gemm import TILES, Tile, int4_gemm, int8_gemm  # noqa: E402

# Llama-3-8B per layer (N, K): fused qkv, o, fused gate_up, down.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 16, 64, 256, 2048)
GROUP = 128
EXTRA_TILES = (Tile(16, 16, 256, 4, 4), Tile(16, 64, 128, 4, 4), Tile(16, 32, 64, 2, 5))


def event_median_ms(fn, reps: int = 20) -> float:
    return statistics.median(_event_times(fn, reps)) * 1e3


def int4_case(n: int, k: int) -> tuple[dict, torch.Tensor]:
    """The CUDA layout of a group-wise int4 quantization of a random weight, and its dequantization."""
    w = torch.randn(n, k, device="cuda") / k**0.5
    q, scale, zero = int4.quantize_groupwise(w, GROUP)
    s_k, z_k = triton_layout.int4_group_params(scale, zero)
    held = {"weight": triton_layout.pack_int4(q), "scale": s_k, "zero": z_k}
    return held, int4.dequantize(q, scale, zero)


def int8_case(n: int, k: int) -> tuple[dict, torch.Tensor]:
    q, scale = quantize_per_channel(torch.randn(n, k, device="cuda") / k**0.5)
    return {"weight": triton_layout.pack_int8(q), "scale": scale}, q.float() * scale[:, None]


def kernel_call(fmt: str, held: dict, x: torch.Tensor, tile: Tile | None = None):
    if fmt == "int4":
        return lambda: int4_gemm(x, held["weight"], held["scale"], held["zero"], None, GROUP, tile=tile)
    return lambda: int8_gemm(x, held["weight"], held["scale"], None, tile=tile)


def torch_dequant_call(fmt: str, held: dict, x: torch.Tensor):
    """torch's dequantize (from the same held tensors) then F.linear, per call."""
    if fmt == "int4":

        def run() -> torch.Tensor:
            q = triton_layout.unpack_int4(held["weight"]).float()  # [N, K]
            s = held["scale"].t().repeat_interleave(GROUP, dim=1)
            z = 8.0 if held["zero"] is None else held["zero"].t().float().repeat_interleave(GROUP, dim=1)
            return F.linear(x, ((q - z) * s).to(x.dtype))

        return run
    return lambda: F.linear(x, (held["weight"].t().float() * held["scale"][:, None]).to(x.dtype))


def measure(fmt: str, name: str, n: int, k: int, sweep: bool) -> list[dict]:
    held, w = (int4_case if fmt == "int4" else int8_case)(n, k)
    w_bf16 = w.to(torch.bfloat16)
    weight_bytes = sum(t.numel() * t.element_size() for t in held.values() if t is not None)
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = x.double() @ w_bf16.double().t()
        got = kernel_call(fmt, held, x)()
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        triton_ms = event_median_ms(kernel_call(fmt, held, x))
        row = {
            "format": fmt,
            "shape": name,
            "N": n,
            "K": k,
            "M": m,
            "rel_err": err,
            "triton_ms": triton_ms,
            "torch_dequant_ms": event_median_ms(torch_dequant_call(fmt, held, x)),
            "bf16_linear_ms": event_median_ms(lambda x=x: F.linear(x, w_bf16)),
            "weight_GBps": weight_bytes / triton_ms / 1e6,
        }
        if sweep:
            tiles = [t for _, t in TILES] + list(EXTRA_TILES)
            row["sweep_ms"] = {str(t): event_median_ms(kernel_call(fmt, held, x, t), reps=10) for t in tiles}
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(r: dict) -> str:
    return (
        f"{r['format']:>4} {r['shape']:>7} M={r['M']:<5} err {r['rel_err']:.1e}  triton {r['triton_ms']:.3f} ms  "
        f"torch dequant+mm {r['torch_dequant_ms']:.3f} ms ({r['torch_dequant_ms'] / r['triton_ms']:.1f}x)  "
        f"bf16 mm {r['bf16_linear_ms']:.3f} ms ({r['bf16_linear_ms'] / r['triton_ms']:.2f}x)  "
        f"{r['weight_GBps']:.0f} GB/s of weights"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--sweep", action="store_true", help="time every tile of the table at every M too")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--max-rel-err", type=float, default=2e-2, help="fail above this (bf16 output rounding)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda is not available", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    rows = [
        row for fmt in ("int4", "int8") for name in args.shapes for row in measure(fmt, name, *SHAPES[name], args.sweep)
    ]
    Path(args.json).write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}) + "\n"
    )  # one line: record reads the last
    worst = max(r["rel_err"] for r in rows)
    print(f"worst relative error {worst:.2e} (limit {args.max_rel_err})")
    return 0 if worst <= args.max_rel_err else 1


if __name__ == "__main__":
    sys.exit(main())
