"""``pagedllm build-kernels``: compile the CPU kernel library ahead of the first start.

A fresh install otherwise compiles it when the engine first starts (about 30 s on 2 cores);
the install line of the README's quick start and CI run this right after ``pip install``.
"""

from __future__ import annotations

import argparse
import time


def add_build_kernels_parser(sub) -> None:
    parser = sub.add_parser(
        "build-kernels",
        help="compile the C++ CPU kernels now (install time) instead of on the first start",
        description="Compile the CPU kernel library for the selected ISA level (PAGEDLLM_CPU_ISA, "
        "native by default) into the kernel cache, or for every level this CPU runs with --all. "
        "Levels already built are only loaded.",
    )
    parser.add_argument("--all", action="store_true", help="every ISA level this CPU runs (the tests use each)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm import cpu_info, envs
    from pagedllm.layers import cpu_kernels

    if not cpu_kernels.kernels_enabled():
        raise ValueError("PAGEDLLM_CPU_KERNELS=0 turns the CPU kernels off; unset it to build them")
    levels = cpu_info.runnable_isas() if args.all else (cpu_kernels.selected_isa(),)
    failed = []
    for level in levels:
        where = cpu_kernels.build_location(level)
        cached = where.is_built()
        print(f"{cpu_info.build_name(level)}: {'loading the cached build' if cached else 'compiling'} ...", flush=True)
        start = time.perf_counter()
        ok = cpu_kernels.build_cpu_library(level)
        print(
            f"  {'ok' if ok else 'FAILED (see the warning above)'} in {time.perf_counter() - start:.1f} s: {where.library}"
        )
        if not ok:
            failed.append(level)
    print(f"kernel cache: {envs.kernel_build_root()}")
    return 1 if failed else 0
