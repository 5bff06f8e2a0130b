"""Where a CPU decode step goes besides the GEMMs, with and without the decode stack, in one process.

    python -m benchmarks.step_overhead [--batch-sizes 1 16 64] [--rounds 15]

Two engines on the SmolLM-135M-shaped dummy model (float32), one with the one-call decode stack
(``layers/cpu_decode_stack.py``) and one running the modules (``PAGEDLLM_CPU_DECODE_STACK=0`` while
it is built), each holding B running requests. Each round times one decode step of each engine and
then the same model's GEMMs alone (every packed linear weight and the LM head, in model order,
on random rows of the right width), so all three see the same machine state. Reported: medians
over rounds of the step, the GEMMs alone, and the rest (step - GEMMs): the Python, the small
kernels, attention, sampling and the engine around them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.decoding import decoding_engine
from pagedllm.entrypoints.bench.common import env_line, environment, format_table, write_dummy_model_dir
from pagedllm.entrypoints.bench.engine_probe import model_runner
from pagedllm.layers.cpu_gemm_kernels import load_cpu_gemm


def _engine(model_dir: Path, stack: bool, batch: int, seed: int) -> Any:
    os.environ["PAGEDLLM_CPU_DECODE_STACK"] = "1" if stack else "0"  # read when the stack is built
    return decoding_engine(model_dir, batch, 32, seed, 10_000, kv_cache_memory=1)


def _packed_weights(engine: Any) -> list[torch.Tensor]:
    model = model_runner(engine).model
    return [m.weight for m in model.modules() if hasattr(m, "quant_method") and getattr(m, "weight", None) is not None]


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(model_dir: Path, batch: int, rounds: int, seed: int) -> list[tuple[Any, ...]]:
    engines = {"stack": _engine(model_dir, True, batch, seed), "modules": _engine(model_dir, False, batch, seed)}
    gemm = load_cpu_gemm()
    weights = [w for w in _packed_weights(engines["stack"]) if w.dim() == 3]
    rows = [torch.randn(batch, w.shape[1]) for w in weights]

    def gemms() -> None:
        for x, w in zip(rows, weights):
            gemm(x, w, None)

    times: dict[str, list[float]] = {"stack": [], "modules": [], "gemms": []}
    for _ in range(rounds):
        for name, engine in engines.items():
            times[name].append(_timed(engine.step))
        times["gemms"].append(_timed(gemms))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return [
        (batch, path, med[path], med["gemms"], med[path] - med["gemms"], 1e3 * batch / med[path])
        for path in ("modules", "stack")
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if load_cpu_gemm() is None:
        raise SystemExit("the CPU kernels are not built: run `pagedllm build-kernels` first")
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as tmp:
        model_dir = write_dummy_model_dir(Path(tmp))
        table = [row for batch in args.batch_sizes for row in measure(model_dir, batch, args.rounds, args.seed)]
    print(env_line(environment()))
    header = ("batch", "path", "step ms", "GEMMs alone ms", "rest ms", "tok/s")
    print(format_table(header, table))


if __name__ == "__main__":
    main()
