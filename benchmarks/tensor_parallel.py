"""Decode step time at tensor-parallel size 2 (one thread per rank) against one rank.

    python -m benchmarks.tensor_parallel [--batch 16] [--rounds 30]

Model: the SmolLM-135M shape (vocab 49152, hidden 576, 30 layers, fp32, dummy weights) except its
heads: 9 query / 3 KV heads cannot be split in two, so this uses 12 query / 4 KV heads of 48,
which keeps every weight matrix the same size (q 576, k and v 192 wide). Each configuration runs
in its own process (``OMP_NUM_THREADS`` set before torch starts), one after the other in one run:
TP=1 with 1 thread with and without the C++ decode stack (``layers/cpu_decode_stack.py``), TP=1
with 2 threads (the same two cores TP=2 gets) with the stack, and TP=2 with 1 thread per rank:
the stack (its all-reduces in C++ between the layers), the modules, both through the shared-memory
all-reduce (``distributed/shm_allreduce.py``, the default on x86), and the modules through gloo.
Each holds ``batch`` running requests (32-token prompts); after warm-up, every engine step is one
decode step of the whole batch; reported: the median step over ``rounds`` steps, tokens per
second, and TP=2 with the stack against TP=1 with the stack at 1 thread (issue 15's aim: >= 1.6x).

For the shared-memory TP=2 rows, rank 0's counters over the timed steps (``ShmAllReduce.stats``):
the time per step spent in collectives (copy in, wait for the peer, sum; measured in C++, so it
includes waiting for the slower rank) and the bytes this rank all-reduced (per layer o_proj and
down_proj, plus the vocab-parallel embedding: ``(2 x layers + 1) x hidden x 4`` in fp32) and
all-gathered (its half of each sampled row's logits) per token. The script also times one
all-reduce of a step's hidden states between two processes, through gloo and through shared memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPE = dict(num_attention_heads=12, num_key_value_heads=4, head_dim=48)


def _model_dir(path: Path) -> Path:
    from pagedllm.entrypoints.bench.common import write_dummy_model_dir

    write_dummy_model_dir(path)
    config = json.loads((path / "config.json").read_text())
    config.update(SHAPE)
    (path / "config.json").write_text(json.dumps(config))
    return path


def decode_engine(model_dir: str, batch: int, **parallel: int) -> Any:
    """An LLMEngine (``parallel``: its tensor/pipeline sizes) holding ``batch`` greedy requests
    with 32-token prompts that never stop."""
    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=model_dir,
            load_format="dummy",
            dtype="float32",
            enable_prefix_caching=False,
            max_num_seqs=batch,
            kv_cache_memory=1,
            **parallel,
        )
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True, detokenize=False)
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(10, 40_000) for _ in range(32)]}, params)
    return engine


def decode_step(model_dir: str, batch: int, rounds: int, **parallel: int) -> dict[str, Any]:
    """Run in a child process: one engine (``parallel``: its tensor/pipeline sizes), median decode step."""
    import torch

    engine = decode_engine(model_dir, batch, **parallel)
    for _ in range(4):  # prefill and warm-up
        engine.step()
    executor = engine.engine_core.executor
    counters = getattr(executor, "collective_stats", lambda: None)
    before = counters()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    after = counters()
    engine.shutdown()
    step = statistics.median(times)
    result = {"threads": torch.get_num_threads(), "step_ms": step * 1e3, "tok_s": batch / step}
    if before is not None and after is not None:  # rank 0's shared-memory collectives over the timed steps
        delta = {k: after[k] - before[k] for k in after}
        result["collective_ms"] = delta["ns"] / 1e6 / rounds
        result["collectives"] = delta["ops"] / rounds
        result["reduced_b"] = delta["bytes_reduced"] / (rounds * batch)
        result["gathered_b"] = delta["bytes_gathered"] / (rounds * batch)
    return result


def _allreduce_worker(rank: int, port: int, numel: int, rounds: int, shm: bool, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    from pagedllm.distributed.shm_allreduce import ShmAllReduce

    reduce = ShmAllReduce(rank, 2).all_reduce if shm else dist.all_reduce
    x = torch.randn(numel)
    for _ in range(10):
        reduce(x)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        reduce(x)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def allreduce_ms(numel: int, shm: bool, rounds: int = 200) -> float:
    """Median time of one all-reduce (shared memory or gloo) of ``numel`` fp32 values between two processes."""
    import multiprocessing as mp

    from pagedllm.executor.multiproc import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, numel, rounds, shm, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join(30)
    return float(result) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--one", type=int, metavar="TP", help=argparse.SUPPRESS)  # a child: one engine
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(
            json.dumps(
                {"tp": args.one, **decode_step(args.model_dir, args.batch, args.rounds, tensor_parallel_size=args.one)}
            )
        )
        return
    from pagedllm.entrypoints.bench.common import env_line, environment, format_table

    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="tp-bench-") as tmp:
        model_dir = str(_model_dir(Path(tmp)))
        # (tp, threads per rank, decode stack, shared-memory all-reduce); gloo: the modules only
        configs = [(1, 1, "1", "1"), (1, 1, "0", "1"), (1, 2, "1", "1")]
        configs += [(2, 1, "1", "1"), (2, 1, "0", "1"), (2, 1, "0", "0")]
        for tp, threads, stack, shm in configs:
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PAGEDLLM_CPU_DECODE_STACK": stack}
            env["PAGEDLLM_SHM_ALLREDUCE"] = shm
            cmd = [sys.executable, "-m", "benchmarks.tensor_parallel", "--one", str(tp)]
            cmd += ["--model-dir", model_dir, "--batch", str(args.batch), "--rounds", str(args.rounds)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            r = results[tp, threads, stack, shm] = json.loads(done.stdout.strip().splitlines()[-1])
            path = "decode stack" if stack == "1" else "modules"
            if tp > 1:
                path += ", shm all-reduce" if shm == "1" else ", gloo all-reduce"
            collectives = f"{r['collective_ms']:.2f} ({r['collectives']:.0f} ops)" if "collective_ms" in r else "-"
            rows.append((f"TP={tp}", f"{threads} per rank", path, r["step_ms"], r["tok_s"], collectives))
    hidden, layers, vocab = 576, 30, 49152
    per_token = (2 * layers + 1) * hidden * 4
    step_numel = args.batch * hidden
    one = {name: allreduce_ms(step_numel, name == "shared-memory") for name in ("gloo", "shared-memory")}
    print(env_line(environment()))
    print(
        format_table(
            ("config", "threads", "path", f"step ms (batch {args.batch})", "tok/s", "collectives ms/step"), rows
        )
    )
    one_rank, tp2 = results[1, 1, "1", "1"], results[2, 1, "1", "1"]
    print(
        f"TP=2 with the decode stack (1 thread per rank) vs TP=1 with it (1 thread): "
        f"{tp2['tok_s'] / one_rank['tok_s']:.2f}x tokens/s (aim: >= 1.6x); "
        f"vs TP=2 running the modules: {tp2['tok_s'] / results[2, 1, '0', '1']['tok_s']:.2f}x"
    )
    if "reduced_b" in tp2:
        print(
            f"measured at TP=2 (decode stack, rank 0): {tp2['reduced_b']:.0f} B all-reduced and "
            f"{tp2['gathered_b']:.0f} B all-gathered per token; {tp2['collective_ms']:.2f} ms of a "
            f"{tp2['step_ms']:.2f} ms step in {tp2['collectives']:.0f} collectives"
        )
    print(
        f"all-reduced per token: {2 * layers + 1} x {hidden} x 4 B = {per_token} B ({per_token / 1024:.1f} KiB); "
        f"per decode step of {args.batch}: {per_token * args.batch / 1024:.0f} KiB in {2 * layers + 1} all-reduces; "
        f"LM head all-gather: {vocab * 4 // 1024} KiB of logits per sampled row"
    )
    for name, ms in one.items():
        print(
            f"{name} all-reduce of one step's hidden states ({step_numel} fp32, {step_numel * 4 // 1024} KiB): "
            f"{ms:.3f} ms median -> {ms * (2 * layers + 1):.1f} ms of all-reduce per step"
        )


if __name__ == "__main__":
    main()
