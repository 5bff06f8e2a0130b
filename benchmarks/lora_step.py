"""Decode step time with mixed LoRA adapters against the base model alone, in one process.

    python -m benchmarks.lora_step [--batch 16] [--adapters 4] [--rank 16] [--rounds 15]

The SmolLM-135M-shaped dummy model (float32) and random rank-``rank`` adapters on all seven
projections (q, k, v, o, gate, up, down; written as PEFT directories at start). Engines, each
holding ``batch`` running requests, stepped in turn every round so all see the same machine state:

- ``base``: LoRA off (decode steps run the one-call C++ decode stack);
- ``base, modules``: LoRA off, layer by layer (``PAGEDLLM_CPU_DECODE_STACK=0``), for reference
  (steps with adapter rows keep the stack: it adds the deltas itself);
- ``lora on, base rows``: ``--enable-lora`` but every request on the base model (the stack runs);
- ``mixed``: ``--enable-lora --max-loras A``, the requests spread round-robin over A adapters;
- ``mixed, bfloat16 slots``: the same with ``--lora-dtype bfloat16`` (half the adapter bytes);
- ``one adapter``: batch / A requests of one adapter, the step of serving adapter by adapter
  (reported x A: the time to give every request one token that way).

Reported: median and minimum step ms over rounds, each with its ratio to ``base`` (the minimum is
the steadier figure on a machine shared with other work).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
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
from pagedllm.lora.peft_files import TARGET_MODULES, projection_shape
from pagedllm.lora.request import LoRARequest
from pagedllm.model_arch import ModelArchConfig, RopeConfig


def _arch() -> ModelArchConfig:
    s = SMOLLM_135M_SHAPE
    return ModelArchConfig(
        "LlamaForCausalLM", "llama", s["vocab_size"], s["hidden_size"], s["intermediate_size"],
        s["num_hidden_layers"], s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"],
        s["max_position_embeddings"], s["rms_norm_eps"], RopeConfig(),
    )  # fmt: skip


def write_adapter(path: Path, rank: int, seed: int) -> Path:
    """A PEFT adapter of random A and B on every projection of every layer."""
    arch, gen = _arch(), torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for proj in TARGET_MODULES:
            fan_in, fan_out = projection_shape(arch, proj)
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES), "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def _engine(model_dir: Path, batch: int, loras: list[LoRARequest | None], stack: bool, **kw: Any) -> Any:
    os.environ["PAGEDLLM_CPU_DECODE_STACK"] = "1" if stack else "0"  # read when the stack is built
    return decoding_engine(model_dir, batch, 32, 0, 10_000, lora_requests=loras, kv_cache_memory=0.25, **kw)


def _timed(engine: Any) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def measure(
    model_dir: Path, loras: list[LoRARequest], batch: int, rounds: int, rank: int
) -> dict[str, tuple[float, float]]:
    lora = dict(enable_lora=True, max_loras=len(loras), max_lora_rank=rank)
    engines = {
        "base": _engine(model_dir, batch, [None], True),
        "base, modules": _engine(model_dir, batch, [None], False),
        "lora on, base rows": _engine(model_dir, batch, [None], True, **lora),
        "mixed": _engine(model_dir, batch, list(loras), True, **lora),
        "mixed, bfloat16 slots": _engine(model_dir, batch, list(loras), True, lora_dtype="bfloat16", **lora),
        "one adapter": _engine(model_dir, batch // len(loras), [loras[0]], True, **lora),
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            times[name].append(_timed(engine))
    return {name: (statistics.median(t) * 1e3, min(t) * 1e3) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="lora-step-") as tmp:
        model_dir = write_dummy_model_dir(Path(tmp) / "model")
        loras = [
            LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", args.rank, i)))
            for i in range(args.adapters)
        ]
        ms = measure(model_dir, loras, args.batch, args.rounds, args.rank)
    med, low = ms["one adapter"]
    ms["one adapter"] = (med * args.adapters, low * args.adapters)  # every request one token, adapter by adapter
    base, base_min = ms["base"]
    print(env_line(environment()))
    print(f"batch {args.batch}, {args.adapters} adapters of rank {args.rank} on q,k,v,o,gate,up,down")
    names = {"one adapter": f"adapter by adapter ({args.adapters} steps of {args.batch // args.adapters})"}
    rows = [
        (names.get(name, name), f"{t:.2f}", f"{t / base:.3f}", f"{m:.2f}", f"{m / base_min:.3f}")
        for name, (t, m) in ms.items()
    ]
    print(format_table(("engine", "median ms", "vs base", "min ms", "vs base"), rows))


if __name__ == "__main__":
    main()
