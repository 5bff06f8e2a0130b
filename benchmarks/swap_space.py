"""TTFT of a re-sent long prompt whose prefix blocks were evicted, with and without --swap-space.

Offline engine on the CPU, dummy weights of the SmolLM-135M shape (fp32). Each round: the long
prompt, then enough other long prompts to evict all its blocks from the KV pool, then the long
prompt again, timed (max_tokens=1: the time to first token). Without a swap tier the re-sent
prompt is recomputed; with one its evicted blocks come back from the tier (on CPU a memory-mapped
temp file; here the page cache still holds it, so this measures the copy, not a disk read).
A "hot" row, the prompt re-sent with no eviction in between (device prefix-cache hit), and a
"cold" row (the first send) bound the result. Medians over --rounds.

    python -m benchmarks.swap_space [--prompt-len 1536] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench.common import write_dummy_model_dir

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def prompt(seed: int, length: int) -> dict:
    rng = random.Random(seed)  # distinct seeds: distinct prompts (no shared first block)
    return {"prompt_token_ids": [rng.randrange(10, 2000) for _ in range(length)]}


def ttft(llm: LLM, p: dict) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate([p], ONE_TOKEN, use_tqdm=False)[0]
    return time.perf_counter() - start, out.num_cached_tokens


class CopyTimer:
    """Wraps the worker's KVTier.copy to add up the seconds spent in tier copies."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        self.tier, self.seconds = runner.kv_tier, 0.0
        copy = self.tier.copy

        def timed(swap_out: list, swap_in: list) -> None:
            start = time.perf_counter()
            copy(swap_out, swap_in)
            self.seconds += time.perf_counter() - start

        self.tier.copy = timed


def rounds(llm: LLM, length: int, n: int, num_others: int) -> dict[str, list]:
    times: dict[str, list] = {"cold": [], "hot": [], "after_eviction": [], "copy_seconds": [], "cached_tokens": []}
    timer = CopyTimer(llm)
    for r in range(n):
        long = prompt(1000 + r, length)
        times["cold"].append(ttft(llm, long)[0])
        times["hot"].append(ttft(llm, long)[0])
        for k in range(num_others):
            ttft(llm, prompt(5000 + 100 * r + k, length))
        timer.seconds = 0.0
        seconds, num_cached = ttft(llm, long)
        times["after_eviction"].append(seconds)
        times["copy_seconds"].append(timer.seconds)
        times["cached_tokens"].append(num_cached)
    return times


def engine(model: str, length: int, swap_gib: float, args: argparse.Namespace) -> LLM:
    num_blocks = -(-(length + 16) // 16) + 8  # one long request and a little more: others evict it
    return LLM(
        model,
        load_format="dummy",
        max_model_len=length + 16,
        num_gpu_blocks_override=num_blocks,
        swap_space=swap_gib,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=1536)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--others", type=int, default=3, help="prompts sent in between to evict the long one")
    p.add_argument("--swap-space", type=float, default=1.0, help="GiB of the swap tier in the swap run")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = p.parse_args()
    model = str(write_dummy_model_dir(Path(tempfile.mkdtemp()) / "smollm"))
    result: dict = {"cpu": cpu_model(), "prompt_len": args.prompt_len, "rounds": args.rounds}
    for name, gib in (("no_swap", 0.0), ("swap", args.swap_space)):
        llm = engine(model, args.prompt_len, gib, args)
        llm.generate([prompt(1, 64)], ONE_TOKEN, use_tqdm=False)  # warm-up
        times = rounds(llm, args.prompt_len, args.rounds, args.others)
        for key, values in times.items():
            result[f"{name}_{key}"] = [round(v, 4) for v in values]
            if key != "cached_tokens":
                result[f"{name}_{key}_median"] = round(statistics.median(values), 4)
        del llm
    speedup = result["no_swap_after_eviction_median"] / result["swap_after_eviction_median"]
    result["ttft_speedup_after_eviction"] = round(speedup, 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
