"""Decode attention kernel of a git ref against the working tree's, timed interleaved in one process.

    python -m benchmarks.attention_ab --base caa7533 [--rounds 7] [--threads 1 2] [--dtype bfloat16]
        [--cache-dtype float16] [--shapes 64x300 64x1024] [--layers 30]

On a shared machine whose speed drifts by tens of percent from one minute to the next, two
benchmark processes run minutes apart cannot tell a 20% kernel change from noise. This builds
``csrc/cpu_paged_attention.cpp`` (with the headers beside it) of both versions as two small
libraries (``benchmarks.kernel_revision``), each registering its op under its own namespace, then
alternates them call batch by call batch on the same inputs and reports medians. Shapes: SmolLM-135M's heads (9 query, 3 KV heads of 64), blocks of 16 in shuffled
order, contexts from in-cache (40 tokens) to streaming from memory (512). Outputs of the two are
checked equal within 1e-4 (within 2 units of the last place for ``--dtype bfloat16 / float16``:
the query, caches and output in that type). The ISA level is the build's (``--isa``, default avx2
on x86-64).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.kernel_revision import build_at_revision

SHAPES = [(1, 40), (4, 40), (64, 40), (16, 512), (64, 300)]  # (sequences, context tokens)

REGISTRATION = """
#include <ATen/core/Tensor.h>
#include <torch/library.h>
void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                            at::Tensor block_table, at::Tensor seq_lens, double scale, int64_t window);
TORCH_LIBRARY(PAGEDLLM_OPS, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, float scale, int window) -> ()");
}
TORCH_LIBRARY_IMPL(PAGEDLLM_OPS, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
"""


def _build(ref: str | None, isa: str) -> object:
    """The decode attention op of ``ref`` (None: the working tree), built for ``isa``."""
    ops = build_at_revision(ref, "cpu_paged_attention.cpp", isa, {"registration.cpp": REGISTRATION})
    return ops.paged_decode_attention


def _inputs(
    batch: int, ctx: tuple[int, int], generator: torch.Generator, dtype: torch.dtype, cache_dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Query, caches, block table and context lengths: each sequence's drawn from [ctx[0], ctx[1]]."""
    blocks = -(-ctx[1] // 16)
    pool = 2 * batch * blocks + 1  # twice the blocks in use, in shuffled order; block 0 unused
    table = (torch.randperm(pool - 1, generator=generator)[: batch * blocks] + 1).view(batch, blocks)
    cache = torch.randn(2, pool, 16, 3, 64, generator=generator).to(cache_dtype)
    q = torch.randn(batch, 9, 64, generator=generator).to(dtype)
    lens = torch.randint(ctx[0], ctx[1] + 1, (batch,), generator=generator)
    return q, cache[0], cache[1], table, lens


def _shape(text: str) -> tuple[int, tuple[int, int]]:
    """'64x300' -> (64, (300, 300)); '64x32-512' -> (64, (32, 512))."""
    seqs, ctx = text.split("x")
    low, _, high = ctx.partition("-")
    shape = int(seqs), (int(low), int(high or low))
    if shape[0] < 1 or not 1 <= shape[1][0] <= shape[1][1]:
        raise ValueError(text)
    return shape


def _time(op, out: torch.Tensor, layers: list[tuple], calls: int) -> float:
    """Seconds per call, the calls going round the layers' inputs."""
    start = time.perf_counter()
    for i in range(calls):
        op(out, *layers[i % len(layers)], 0.125, 0)
    return (time.perf_counter() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git ref of the baseline kernel")
    p.add_argument("--rounds", type=int, default=7, help="alternations per shape (median)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--isa", default="avx2", help="kernel level to build both with (default avx2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--cache-dtype",
        default=None,
        choices=["bfloat16", "float16"],
        help="a 16-bit KV cache under a float32 query (--kv-cache-dtype); default: the query's dtype",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=1,
        help="caches of this many layers (up to ~256 MB of them), each call the next layer's: with 30, "
        "K/V come from memory as in a model's step, where the weights streaming past evict them, once "
        "the layers a timed batch of calls goes round outgrow the last-level cache; small batches at "
        "short contexts stay in a big L3 (64 sequences of 50 tokens: ~5 MB of K/V a layer) "
        "(default 1: one layer's, in cache between calls when small)",
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        default=[f"{b}x{c}" for b, c in SHAPES],
        help="SEQUENCESxCONTEXT, or SEQUENCESxLOW-HIGH for contexts drawn from LOW..HIGH (default: %(default)s)",
    )
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    cache_dtype = getattr(torch, args.cache_dtype) if args.cache_dtype else dtype
    if cache_dtype != dtype and dtype != torch.float32:
        p.error("--cache-dtype goes with a float32 query (--dtype float32)")
    try:
        shapes = [_shape(shape) for shape in args.shapes]
    except ValueError:
        p.error(f"--shapes takes SEQUENCESxCONTEXT or SEQUENCESxLOW-HIGH such as 64x300 64x32-512, not {args.shapes}")
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 * torch.finfo(dtype).eps, "atol": 1e-5}
    ops = {"base": _build(args.base, args.isa), "new": _build(None, args.isa)}
    generator = torch.Generator().manual_seed(0)
    print(
        f"decode attention, {args.base} (base) vs working tree (new), {args.isa} build, {args.dtype}; "
        f"median of {args.rounds}; --layers {args.layers}"
    )
    print("threads  seqs  context   base us    new us  new speed  base GB/s new GB/s (K/V read)")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch, ctx in shapes:
            q, *rest = _inputs(batch, ctx, generator, dtype, cache_dtype)
            layer_bytes = 2 * rest[0].numel() * cache_dtype.itemsize
            layers = [(q, *rest)]
            for _ in range(min(args.layers, -(-(256 << 20) // layer_bytes)) - 1):
                cache = torch.randn(2, *rest[0].shape, generator=generator).to(cache_dtype)
                layers.append((q, cache[0], cache[1], *rest[2:]))
            outs = {k: torch.empty_like(q) for k in ops}
            tokens = int(rest[-1].sum())
            calls = max(3, 20_000 // tokens)  # a few ms per timed batch
            times: dict[str, list[float]] = {k: [] for k in ops}
            for _ in range(args.rounds):
                for k, op in ops.items():
                    times[k].append(_time(op, outs[k], layers, calls))
            torch.testing.assert_close(outs["new"], outs["base"], **tol)
            base, new = (statistics.median(times[k]) for k in ("base", "new"))
            kv_bytes = tokens * 2 * 3 * 64 * cache_dtype.itemsize  # K and V rows read per call
            print(
                f"{threads:7d} {batch:5d} {'-'.join(map(str, sorted(set(ctx)))):>8} {base * 1e6:9.1f} {new * 1e6:9.1f} {base / new:9.2f}x"
                f" {kv_bytes / base / 1e9:8.1f} {kv_bytes / new / 1e9:8.1f}"
            )


if __name__ == "__main__":
    main()
