"""Decode rate with two pipeline stages (one thread each), with a batch per stage in flight and with
one, against one process; and the cost of the stage-to-stage transfer.

    python -m benchmarks.pipeline_parallel [--batch 16] [--rounds 30]

Model: the SmolLM-135M shape (vocab 49152, hidden 576, 30 layers, fp32, dummy weights). Each
configuration runs in its own process (``OMP_NUM_THREADS`` set before torch starts): one process
with 1 and with 2 threads, each with and without the fused decode stack (which stands aside in a
pipeline stage), and PP=2 (15 + 15 layers) with one thread per stage, keeping two batches in
flight (the default: while the last stage runs one half of the requests, the first runs the
other half) and one (``PAGEDLLM_PP_BATCHES_IN_FLIGHT=1``: the stages take turns). Each holds
``batch`` running requests (32-token prompts); after warm-up it times how long every request
takes to decode ``rounds`` more tokens; reported: that time per round (every request one token
further; one process: one decode step of the whole batch) and tokens per second.

The script also times, between two processes, one step's transfer as the stages make it: a gloo
``send``/``recv`` of the ``[2, tokens, hidden]`` fp32 hidden states and residual (for a decode
step of ``batch`` tokens and a 512-token prefill chunk).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.tensor_parallel import decode_engine

HIDDEN = 576


def _transfer_worker(rank: int, port: int, tokens: list[int], rounds: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    from pagedllm.distributed.pipeline import PPGroup

    stage = PPGroup(rank, 2)
    result = {}
    for n in tokens:
        x = torch.randn(n, HIDDEN)
        times = []
        for i in range(rounds + 10):
            start = time.perf_counter()
            if rank == 0:
                stage.send(x, x)
            else:
                stage.recv(n, HIDDEN, torch.float32)
            if i >= 10:
                times.append(time.perf_counter() - start)
        result[f"send/recv {n} tokens"] = statistics.median(times)
    if rank == 1:  # the receiver: its wait includes the transfer
        out.put(result)
    dist.destroy_process_group()


def transfer_ms(tokens: list[int], rounds: int = 200) -> dict[str, float]:
    """Median time of each transfer a step makes between two stages."""
    import multiprocessing as mp

    from pagedllm.executor.multiproc import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_transfer_worker, args=(r, port, tokens, rounds, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join(30)
    return {name: seconds * 1e3 for name, seconds in result.items()}


def decode_rate(model_dir: str, batch: int, rounds: int, pipeline_parallel_size: int) -> dict[str, Any]:
    """Run in a child process: one engine; the time every request takes to decode ``rounds`` tokens."""
    import torch

    engine = decode_engine(model_dir, batch, pipeline_parallel_size=pipeline_parallel_size)
    requests = engine.engine_core.scheduler.requests

    def least_decoded() -> int:
        return min(r.num_output_tokens for r in requests.values())

    while least_decoded() < 4:  # prefill and warm-up
        engine.step()
    first = least_decoded()
    start = time.perf_counter()
    while least_decoded() < first + rounds:
        engine.step()
    seconds = time.perf_counter() - start
    tokens = sum(r.num_output_tokens for r in requests.values()) - first * batch
    engine.shutdown()
    return {"threads": torch.get_num_threads(), "round_ms": seconds / rounds * 1e3, "tok_s": tokens / seconds}


# (pipeline stages, threads per process, fused decode stack, batches in flight)
CONFIGS = [(1, 1, "1", 1), (1, 1, "0", 1), (1, 2, "1", 1), (1, 2, "0", 1), (2, 1, "0", 1), (2, 1, "0", 2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--one", type=int, metavar="PP", help=argparse.SUPPRESS)  # a child: one engine
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(decode_rate(args.model_dir, args.batch, args.rounds, args.one)))
        return
    from pagedllm.entrypoints.bench.common import env_line, environment, format_table, write_dummy_model_dir

    rows = []
    with tempfile.TemporaryDirectory(prefix="pp-bench-") as tmp:
        model_dir = str(write_dummy_model_dir(Path(tmp)))
        for pp, threads, stack, in_flight in CONFIGS:
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PAGEDLLM_CPU_DECODE_STACK": stack}
            if pp > 1:
                env["PAGEDLLM_PP_BATCHES_IN_FLIGHT"] = str(in_flight)
            cmd = [sys.executable, "-m", "benchmarks.pipeline_parallel", "--one", str(pp)]
            cmd += ["--model-dir", model_dir, "--batch", str(args.batch), "--rounds", str(args.rounds)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            path = "decode stack" if stack == "1" else "modules"
            flight = f"{in_flight} in flight" if pp > 1 else "-"
            rows.append((f"PP={pp}", f"{threads} per process", path, flight, r["round_ms"], r["tok_s"]))
    print(env_line(environment()))
    header = ("config", "threads", "path", "batches", f"ms per token of all {args.batch}", "tok/s")
    print(format_table(header, rows))
    for name, ms in transfer_ms([args.batch, 512]).items():
        print(f"{name}: {ms:.3f} ms median")


if __name__ == "__main__":
    main()
