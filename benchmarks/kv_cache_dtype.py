"""Decode steps with a float32 KV cache against bfloat16 / float16 ones (``--kv-cache-dtype``), in one process.

    python -m benchmarks.kv_cache_dtype [--batch-sizes 1 16 64] [--contexts 256 1024]
                                        [--rounds 15] [--quantization int4]

One engine per cache dtype on the SmolLM-135M-shaped dummy model (float32 weights, or
``--quantization``), each holding B running requests whose prompts are C tokens long. Each round
times one decode step of every engine in turn, so all see the same machine state; reported are
the medians over rounds, each 16-bit cache's speed-up over float32's, and the bytes a step reads
from the cache (K and V of every context token in every layer). At long contexts and big batches
decode attention reads more cache than weights; a 16-bit cache halves those bytes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.decoding import decoding_engine
from pagedllm.entrypoints.bench.common import env_line, environment, format_table, read_hf_config, write_dummy_model_dir
from pagedllm.entrypoints.bench.engine_probe import model_runner
from pagedllm.entrypoints.bench.machine import model_cost
from pagedllm.layers.cpu_kernels import kernel_build

CACHE_DTYPES = ("auto", "bfloat16", "float16")


def _engine(model_dir: Path, kv: str, batch: int, context: int, args: argparse.Namespace) -> Any:
    return decoding_engine(
        model_dir,
        batch,
        context,
        args.seed,
        args.rounds + 32,
        pool_tokens=context + args.rounds + 64,
        quantization=args.quantization,
        kv_cache_dtype=kv,
    )


def measure(model_dir: Path, batch: int, context: int, args: argparse.Namespace) -> list[tuple[Any, ...]]:
    engines = {kv: _engine(model_dir, kv, batch, context, args) for kv in CACHE_DTYPES}
    times: dict[str, list[float]] = {kv: [] for kv in engines}
    for r in range(args.rounds):
        order = list(engines)[r % len(engines) :] + list(engines)[: r % len(engines)]
        for kv in order:
            start = time.perf_counter()
            engines[kv].step()
            times[kv].append(time.perf_counter() - start)
    med = {kv: statistics.median(t) * 1e3 for kv, t in times.items()}
    rows = []
    for kv, engine in engines.items():
        cache = model_runner(engine).kv_caches[0]
        kv_mb = batch * context * model_cost(read_hf_config(model_dir), "float32", kv).kv_bytes_per_token / 1e6
        rows.append(
            (
                batch,
                context,
                str(cache.dtype).removeprefix("torch."),
                f"{kv_mb:.0f}",
                f"{med[kv]:.2f}",
                f"{1e3 * batch / med[kv]:.1f}",
                f"{med['auto'] / med[kv]:.2f}x",
            )
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--quantization", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kv-cache-dtype-") as tmp:
        model_dir = write_dummy_model_dir(Path(tmp))
        table = [row for b in args.batch_sizes for c in args.contexts for row in measure(model_dir, b, c, args)]
    print(env_line(environment()), "| kernels:", kernel_build(), "| weights:", args.quantization or "float32")
    header = ("batch", "context", "KV cache", "cache MB read", "step ms", "tok/s", "vs float32")
    print(format_table(header, table))


if __name__ == "__main__":
    main()
