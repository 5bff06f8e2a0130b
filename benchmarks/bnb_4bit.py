"""bitsandbytes NF4 checkpoints on the int4 kernel with the code table: decode step time and
the linears' bytes against the same checkpoint requantized to int8 per channel (how pagedllm ran
NF4 before ``CodebookInt4Method``; rebuilt here by switching the format back to the int8 path
while that engine loads) and the model's float32 checkpoint under ``--quantization int4``.

    python -m benchmarks.bnb_4bit [--batch-sizes 1 16] [--rounds 5] [--steps 20]

A SmolLM-135M-shaped Llama (tied embeddings) with random weights (std 0.02) is written twice:
float32 safetensors, and NF4 with double quantization as bitsandbytes' own ``quantize_4bit``
serializes it (blocks of 64; transformers' ``load_in_4bit`` layout), the embeddings and norms
float32. Each system holds B greedy requests of 32-token prompts; each round times ``--steps``
decode steps of every system in turn (the order rotating), and the table shows medians. Needs
``bitsandbytes`` (a test dependency). The LM head is float32 in both NF4 rows (bitsandbytes leaves it unquantized), int8
groups of 32 in the int4 row. The last stdout line is the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from benchmarks.decoding import decoding_engine
from pagedllm.entrypoints.bench.common import (
    SMOLLM_135M_SHAPE,
    env_line,
    environment,
    format_table,
    write_dummy_model_dir,
)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_checkpoints(root: Path) -> tuple[Path, Path]:
    """(float32 dir, NF4 dir) of the same random weights."""
    import bitsandbytes.functional as bnb

    float_dir, nf4_dir = write_dummy_model_dir(root / "float32"), write_dummy_model_dir(root / "nf4")
    shape = SMOLLM_135M_SHAPE
    hidden, inter, heads, kv_heads = (
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
    )
    kv = hidden // heads * kv_heads
    sizes = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, hidden)}
    sizes |= {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    gen = torch.Generator().manual_seed(0)
    floats: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(shape["vocab_size"], hidden, generator=gen) * 0.02,
        "model.norm.weight": torch.ones(hidden),
    }
    nf4: dict[str, torch.Tensor] = dict(floats)
    for i in range(shape["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            floats[f"model.layers.{i}.{norm}.weight"] = nf4[f"model.layers.{i}.{norm}.weight"] = torch.ones(hidden)
        for name in LINEARS:
            module = (
                f"model.layers.{i}.{'mlp' if name in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{name}"
            )
            w = torch.randn(*sizes[name], generator=gen) * 0.02
            floats[f"{module}.weight"] = w
            q, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
            nf4[f"{module}.weight"] = q
            nf4.update({f"{module}.weight.{k}": v for k, v in state.as_dict(packed=True).items()})
    save_file(floats, float_dir / "model.safetensors")
    save_file({k: v.contiguous() for k, v in nf4.items()}, nf4_dir / "model.safetensors")
    config = json.loads((nf4_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
    }
    (nf4_dir / "config.json").write_text(json.dumps(config))
    return float_dir, nf4_dir


@contextmanager
def requantized_to_int8() -> Iterator[None]:
    """NF4 layers the old way while an engine loads: dequantized, requantized per channel (int8)."""
    from pagedllm.layers.quantization import bitsandbytes as bnb_format
    from pagedllm.layers.quantization.prequantized import CheckpointScheme, PrequantizedConfig

    saved = bnb_format.FourBitScheme.convert, bnb_format.BitsAndBytes4bitConfig.get_linear_method
    bnb_format.FourBitScheme.convert = CheckpointScheme.convert  # type: ignore[method-assign]
    bnb_format.BitsAndBytes4bitConfig.get_linear_method = PrequantizedConfig.get_linear_method  # type: ignore[method-assign]
    try:
        yield
    finally:
        bnb_format.FourBitScheme.convert, bnb_format.BitsAndBytes4bitConfig.get_linear_method = saved  # type: ignore[method-assign]


def weight_bytes(engine: Any) -> int:
    """Bytes of the model's linear layers' parameters and buffers (weights, scales, tables)."""
    model = engine.engine_core.executor.worker.model_runner.model
    total = 0
    for name, module in model.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            total += sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    env = environment()
    with tempfile.TemporaryDirectory() as tmp:
        float_dir, nf4_dir = write_checkpoints(Path(tmp))
        systems = {
            "nf4, int4 kernel + code table": (nf4_dir, None, nullcontext),
            "nf4, requantized to int8": (nf4_dir, None, requantized_to_int8),
            "float32 checkpoint, --quantization int4": (float_dir, "int4", nullcontext),
        }
        report: dict[str, Any] = {"env": env, "batches": {}}
        print(env_line(env))
        for batch in args.batch_sizes:
            steps = (args.rounds + 1) * args.steps + 8
            engines = {}
            for name, (d, q, loading) in systems.items():
                with loading():
                    engines[name] = decoding_engine(
                        d, batch, 32, 0, steps, load_format="auto", quantization=q, pool_tokens=64 + steps
                    )
            times: dict[str, list[float]] = {name: [] for name in engines}
            names = list(engines)
            for r in range(args.rounds + 1):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        engines[name].step()
                    if r:  # round 0 warms up
                        times[name].append((time.perf_counter() - start) / args.steps)
            base = statistics.median(times[names[1]])
            rows, result = [], {}
            for name in names:
                ms = statistics.median(times[name]) * 1e3
                nbytes = weight_bytes(engines[name])
                rows.append([name, ms, base * 1e3 / ms, nbytes / 1e6])
                result[name] = {"step_ms": ms, "linear_mb": nbytes / 1e6}
            report["batches"][batch] = result
            print(f"\nbatch {batch}: median of {args.rounds} rounds of {args.steps} decode steps")
            print(format_table(["system", "step ms", "x requantized", "linear MB"], rows))
            del engines
    print(json.dumps(report))


if __name__ == "__main__":
    main()
