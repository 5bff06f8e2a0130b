"""Speculative decoding (n-gram prompt lookup): output tokens/s with and without, in one run.

    python -m benchmarks.spec_decode [--model DIR] [--batch-sizes 1 16] [--repeats 2] [--workloads ...]

Three engines on the same settings: speculation off, n-gram speculation with the adaptive limit
(the default, ``spec_decode/adaptive.py``) and n-gram always proposing k tokens
(``"adaptive": false``). Each workload runs on them in turn, ``--repeats`` times (best and
median kept), so all see the same machine state:

* ``copy``: the output repeats text in the prompt, as when a model rewrites code with one
  change. A random-weight model cannot be asked to copy, so the workload is built from the model
  itself: C is its greedy continuation of a random prompt P, and the request is P + C + P. The
  default model is the SmolLM-135M shape with Mistral-style sliding-window attention (window
  ``--sliding-window``): its receptive field (layers x window) is shorter than P, so after the
  second P it sees exactly what it saw after the first and writes C again — text that prompt
  lookup finds. The report gives the share of outputs equal to C, and the acceptance rate.
* ``no-repetition``: random prompts, temperature 1.0 over the model's nearly flat distribution:
  the output almost never repeats, proposals are rare, and the figure is what speculation
  costs when it cannot help.
* ``low-acceptance``: prompts and outputs (``allowed_token_ids``, temperature 1.0) drawn from
  ``--alphabet`` tokens, like digits or whitespace: n-grams recur by chance, so proposals come
  nearly every step, and about one in ``--alphabet`` is accepted. Verification costs more than
  it saves here; the adaptive engine should back off to plain decoding.

Batch size B runs B requests together. Reported per engine (medians over the repeats): decode
tok/s = B / mean time per output token after the first (TPOT), and end-to-end output tok/s
(prefill included). Dummy weights, float32. The last stdout line is the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench.common import env_line, environment, format_table, write_dummy_model_dir

# The engines with speculation: adaptive (the default) and always proposing k tokens.
SPEC_ENGINES = {"ngram": True, "ngram_fixed": False}


def _requests(n: int, prompt_len: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(prompt_len)]} for _ in range(n)]


def _timed(llm: LLM, prompts: list[dict], params: SamplingParams) -> dict[str, float]:
    """One generate call: end-to-end output tok/s (prefill included) and decode tok/s, the batch
    over the mean time per output token after the first (TPOT, as vLLM reports it)."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    tpots = [
        (o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1) for o in outputs
    ]
    return {
        "e2e_tok_s": tokens / elapsed,
        "decode_tok_s": len(outputs) / statistics.mean(tpots),
        "drafted": sum(o.metrics.spec_num_draft_tokens for o in outputs),
        "accepted": sum(o.metrics.spec_num_accepted_tokens for o in outputs),
    }


def _bench(engines: dict[str, LLM], prompts: list[dict], params: SamplingParams, repeats: int) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    names = list(engines)
    for i in range(repeats):
        # Each round starts with another engine, so a load that drifts over a round hits them alike.
        for name in names[i % len(names) :] + names[: i % len(names)]:
            runs[name].append(_timed(engines[name], prompts, params))
    result: dict = {}
    for metric in ("decode_tok_s", "e2e_tok_s"):
        for name, rs in runs.items():
            values = [r[metric] for r in rs]
            result[f"{name}_{metric}"] = {"best": max(values), "median": statistics.median(values)}
        for name in SPEC_ENGINES:
            for stat in ("best", "median"):
                ratio = result[f"{name}_{metric}"][stat] / result[f"off_{metric}"][stat]
                result[f"{name}_{metric}_speedup_{stat}"] = ratio
    for name in SPEC_ENGINES:
        drafted = sum(r["drafted"] for r in runs[name])
        result[f"{name}_drafted_per_run"] = drafted / repeats
        result[f"{name}_acceptance_rate"] = sum(r["accepted"] for r in runs[name]) / drafted if drafted else None
    return result


def _sliding_window_model(window: int) -> str:
    """The default bench model's directory, switched to Mistral sliding-window attention."""
    path = write_dummy_model_dir(Path(tempfile.mkdtemp()) / "smollm")
    if window:
        config = json.loads((path / "config.json").read_text())
        config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)


def _copy_fidelity(llm: LLM, prompts: list[dict], params: SamplingParams, copies: list[list[int]]) -> float:
    """Share of copy-workload outputs identical to the text they were meant to repeat."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(o.outputs[0].token_ids == c for o, c in zip(outputs, copies)) / len(copies)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: dummy SmolLM-135M shape)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=96, help="length of P (copy prompts are 2P + C)")
    p.add_argument("--output-len", type=int, default=192)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--sliding-window",
        type=int,
        default=4,
        help="window of the default model (0: full attention); 30 layers x (4 - 1) + 1 = 91 < P",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--alphabet", type=int, default=16, help="low-acceptance: prompts and outputs use only this many tokens"
    )
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    args = p.parse_args()
    model = args.model or _sliding_window_model(args.sliding_window)
    load_format = "auto" if args.model else "dummy"
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    greedy = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    sampled = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0, seed=args.seed)
    alphabet = list(range(100, 100 + args.alphabet))
    low = SamplingParams(
        max_tokens=args.output_len, ignore_eos=True, temperature=1.0, seed=args.seed, allowed_token_ids=alphabet
    )
    report = {"env": environment(), "args": vars(args), "results": []}
    for batch in args.batch_sizes:
        common = dict(
            load_format=load_format,
            max_model_len=2 * (args.prompt_len + args.output_len) + 16,
            max_num_seqs=batch,
            seed=args.seed,
        )
        engines = {"off": LLM(model, **common)}
        for name, adaptive in SPEC_ENGINES.items():
            engines[name] = LLM(model, speculative_config={**spec, "adaptive": adaptive}, **common)
        vocab = engines["off"].llm_engine.config.model_config.arch.vocab_size
        prompts = _requests(batch, args.prompt_len, vocab, args.seed)
        if "copy" in args.workloads:
            copies = [o.outputs[0].token_ids for o in engines["off"].generate(prompts, greedy, use_tqdm=False)]
            copy_prompts = [
                {"prompt_token_ids": p["prompt_token_ids"] + c + p["prompt_token_ids"]} for p, c in zip(prompts, copies)
            ]
            fidelity = _copy_fidelity(engines["off"], copy_prompts, greedy, copies)
            result = _bench(engines, copy_prompts, greedy, args.repeats)
            report["results"].append({"workload": "copy", "batch": batch, "outputs_equal_to_copy": fidelity, **result})
        if "no-repetition" in args.workloads:
            result = _bench(engines, prompts, sampled, args.repeats)
            report["results"].append({"workload": "no-repetition", "batch": batch, **result})
        if "low-acceptance" in args.workloads:
            rng = random.Random(args.seed)
            small = [{"prompt_token_ids": rng.choices(alphabet, k=args.prompt_len)} for _ in range(batch)]
            result = _bench(engines, small, low, args.repeats)
            report["results"].append({"workload": "low-acceptance", "batch": batch, **result})
        del engines
    print(env_line(report["env"]))
    print(format_table(_HEADERS, [_row(r) for r in report["results"]]))
    print(json.dumps(report))


WORKLOADS = ("copy", "no-repetition", "low-acceptance")
_HEADERS = ["workload", "batch", "off decode tok/s"]
for _name in SPEC_ENGINES:
    _HEADERS += [f"{_name} decode tok/s", f"{_name} decode x", f"{_name} e2e x", f"{_name} drafts/run", f"{_name} acc."]


def _row(r: dict) -> list:
    row = [r["workload"], r["batch"], f"{r['off_decode_tok_s']['median']:.1f}"]
    for name in SPEC_ENGINES:
        acceptance = r[f"{name}_acceptance_rate"]
        row += [
            f"{r[f'{name}_decode_tok_s']['median']:.1f}",
            f"{r[f'{name}_decode_tok_s_speedup_median']:.2f}x",
            f"{r[f'{name}_e2e_tok_s_speedup_median']:.2f}x",
            f"{r[f'{name}_drafted_per_run']:.0f}",
            "-" if acceptance is None else f"{100 * acceptance:.1f}%",
        ]
    return row


if __name__ == "__main__":
    main()
