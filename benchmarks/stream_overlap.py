"""Does this CPU overlap a weight stream's memory reads with the arithmetic on it, and with how many
streams per thread and how far a software prefetch ahead? (``benchmarks/stream_overlap.cpp``)

    python -m benchmarks.stream_overlap [--isa native] [--mib 512] [--threads 2]
                                        [--work 0 2] [--streams 1 2 4 8] [--ahead 0 16 64]

A batch-1 decode step streams every weight once and does a few vector operations per weight: the
step is as fast as the memory only if the reads and the arithmetic overlap. The C++ loop (built
with the kernels' flags for ``--isa``, over ``csrc/cpu_vec.h``) widens int8 weights to floats
with 1 + W FMAs per vector (W = 0: the int8 LM head's tile at one row) from S sequential streams
per thread with a software prefetch D lines ahead in each (0: the hardware prefetchers alone).
The table shows GB/s from memory per (S, D) next to the arithmetic's own rate (in L2) and the
two bounds: full overlap reaches the slower of memory and arithmetic, none about
1 / (1 / memory + 1 / arithmetic). The packed layouts decide S: the int8 and int4 layouts
interleave a group's 4 panels into one stream per thread, the float32 one reads 4 panels side by
side (4 streams). The last stdout line is the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from pagedllm import cpu_info
from pagedllm.entrypoints.bench.common import env_line, environment, format_table
from pagedllm.entrypoints.bench.machine import measure_limits
from pagedllm.layers.cpu_kernels import compile_flags, selected_isa

SOURCE = Path(__file__).with_suffix(".cpp")


def build(level: str, folder: Path) -> Path:
    """The loop compiled for ``level`` (the kernels' flags) into ``folder``."""
    binary = folder / f"stream_overlap_{level}"
    flags = [f for f in compile_flags(level) if not f.startswith("-DPAGEDLLM_OPS")]
    subprocess.run(["g++", "-std=c++17", *flags, str(SOURCE), "-o", str(binary)], check=True)
    return binary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isa", default="native", help="kernel level to build the loop for (default: the engine's)")
    p.add_argument("--mib", type=int, default=512, help="buffer read from memory (well above the last-level cache)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=int, nargs="+", default=[0, 2], help="extra FMAs per vector (W)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8], help="streams per thread (S)")
    p.add_argument("--ahead", type=int, nargs="+", default=[0, 16, 64], help="prefetch distances in lines (D)")
    args = p.parse_args()
    if min(args.work) < 0 or min(args.streams) < 1 or min(args.ahead) < 0 or args.mib < 1 or args.threads < 1:
        p.error("--work and --ahead take values >= 0, --streams, --mib and --threads >= 1")
    level = selected_isa() if args.isa == "native" else args.isa
    if level not in cpu_info.runnable_isas():
        p.error(f"this CPU cannot run the {level} build (it runs {', '.join(cpu_info.runnable_isas())})")
    with tempfile.TemporaryDirectory(prefix="stream-overlap-") as tmp:
        binary = build(level, Path(tmp))
        run = [str(binary), str(args.mib), str(args.threads)] + [
            ",".join(map(str, v)) for v in (args.work, args.streams, args.ahead)
        ]
        lines = subprocess.run(run, check=True, capture_output=True, text=True).stdout.splitlines()
    limits = measure_limits(copy_mib=256)
    arithmetic: dict[int, float] = {}
    rows, results = [], []
    for line in lines:
        words = line.split()
        if words[0] == "arithmetic":
            arithmetic[int(words[1][2:])] = float(words[2])
            continue
        work, streams, ahead = (int(w.split("=")[1]) for w in words[1:4])
        gbps, compute = float(words[4]), arithmetic[work]
        no_overlap = 1 / (1 / limits.read_gbps + 1 / compute)
        rows.append((work, streams, ahead, gbps, compute, min(limits.read_gbps, compute), no_overlap))
        results.append({"work": work, "streams": streams, "ahead": ahead, "gbps": gbps, "arithmetic_gbps": compute})
    print(env_line(environment()))
    print(
        f"ISA level {level}, {args.threads} threads, {args.mib} MiB; the machine's read bandwidth {limits.read_gbps:.1f} GB/s"
    )
    header = ("W", "streams", "ahead", "GB/s", "arithmetic alone", "full overlap", "no overlap")
    print(format_table(header, rows))
    print(
        json.dumps({"benchmark": "stream_overlap", "level": level, "read_gbps": limits.read_gbps, "results": results})
    )


if __name__ == "__main__":
    main()
