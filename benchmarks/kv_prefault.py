"""A new engine's first prefills on a fresh KV pool, with and without the KV prefaulter.

    python -m benchmarks.kv_prefault [--pairs 3] [--prefills 8] [--prompt-len 512] [--quantization w8a8]

Each run is a fresh process (the order alternating pair by pair) that builds the dummy
SmolLM-135M-shaped engine with the default 4 GiB CPU KV pool, waits a second (the prefaulter
populates its first PAGEDLLM_KV_PREFAULT_MIB in the background meanwhile; the run without it
waits too), then times ``--prefills`` prompts of ``--prompt-len`` tokens one after another, each
on blocks no step has written before (the free queue hands blocks out in id order). Reported:
the median prefill per setting and the ratio off / on. The last stdout line is the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from pagedllm.entrypoints.bench.common import environment

_RUN = """
import json, random, sys, time
from pagedllm import LLM, SamplingParams
quantization = sys.argv[1] if sys.argv[1] != "none" else None
prefills, prompt_len = int(sys.argv[2]), int(sys.argv[3])
llm = LLM(model=None, load_format="dummy", quantization=quantization, enable_prefix_caching=False,
          max_model_len=prompt_len + 16)
rng = random.Random(0)
params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
def prompt():
    return {"prompt_token_ids": [rng.randrange(10, 40000) for _ in range(prompt_len)]}
llm.generate([prompt()], params, use_tqdm=False)  # warm-up: first-call set-up
time.sleep(1.0)
times = []
for _ in range(prefills):
    start = time.perf_counter()
    llm.generate([prompt()], params, use_tqdm=False)
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def run(prefault_mib: int, args: argparse.Namespace) -> list[float]:
    env = {**os.environ, "PAGEDLLM_KV_PREFAULT_MIB": str(prefault_mib)}
    cmd = [sys.executable, "-c", _RUN, args.quantization, str(args.prefills), str(args.prompt_len)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--prefills", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--quantization", default="none")
    p.add_argument("--prefault-mib", type=int, default=128, help="the setting timed against 0 (off)")
    args = p.parse_args()
    runs: dict[str, list[float]] = {"on": [], "off": []}
    for pair in range(args.pairs):
        order = ("on", "off") if pair % 2 == 0 else ("off", "on")
        for name in order:
            times = run(args.prefault_mib if name == "on" else 0, args)
            runs[name] += times
            print(f"pair {pair} {name}: median prefill {statistics.median(times) * 1e3:.1f} ms", flush=True)
    on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
    print(
        f"median prefill of {args.prompt_len} tokens: prefaulter on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, "
        f"off / on {off / on:.3f}"
    )
    print(
        json.dumps(
            {
                "benchmark": "kv_prefault",
                "env": environment(),
                "args": vars(args),
                "on_s": on,
                "off_s": off,
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    main()
