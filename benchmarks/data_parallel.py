"""Server throughput at data-parallel size 2 (two engine cores, one thread each) against one
engine core (with all the threads), through the real ``pagedllm serve`` and HTTP path.

    python -m benchmarks.data_parallel [--requests 16] [--max-tokens 64] [--rounds 2]

Model: the SmolLM-135M shape with dummy weights (float32, ``load_format="dummy"``), no prefix
caching (distinct random prompts). Each configuration is its own server process (started, then
stopped by SIGTERM); ``requests`` completions of 32 prompt tokens and ``max_tokens`` generated
tokens (ignore_eos) are sent at once, ``rounds`` times after one warm-up round; reported: the
best round's wall time and generated tokens per second. On a machine with as many cores as
engines the two configurations use the same cores; DP trades one batch on N threads for N
batches on one thread each.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from pagedllm.executor.multiproc import free_port


def _start(model_dir: Path, dp: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(model_dir), "--load-format", "dummy"]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--served-model-name", "m", "--no-enable-prefix-caching"]
    cmd += ["--max-model-len", "512", "--kv-cache-memory", "1", "--data-parallel-size", str(dp)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError("server not ready in 300 s")


def _round(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    def one(prompt: list[int]) -> int:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        resp.raise_for_status()
        return int(resp.json()["usage"]["completion_tokens"])

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, prompts))
    return time.perf_counter() - start, tokens


def _measure(model_dir: Path, dp: int, args: argparse.Namespace, log: Path) -> dict:
    rng = random.Random(dp)
    proc, url = _start(model_dir, dp, log)
    try:
        best = float("inf")
        tokens = 0
        for i in range(args.rounds + 1):
            prompts = [[rng.randrange(10, 40_000) for _ in range(32)] for _ in range(args.requests)]
            wall, tokens = _round(url, prompts, args.max_tokens)
            if i:  # round 0 warms up
                best = min(best, wall)
        return {"dp": dp, "wall_s": best, "tok_s": tokens / best}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from pagedllm.entrypoints.bench.common import write_dummy_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_dummy_model_dir(Path(tmp) / "model")
        rows = [_measure(model_dir, dp, args, Path(tmp) / f"dp{dp}.log") for dp in (1, 2)]
    base = rows[0]["tok_s"]
    print("| config | best round s | generated tok/s | vs DP=1 |\n|---|---|---|---|")
    for row in rows:
        print(f"| DP={row['dp']} | {row['wall_s']:.2f} | {row['tok_s']:.0f} | {row['tok_s'] / base:.2f} |")


if __name__ == "__main__":
    main()
