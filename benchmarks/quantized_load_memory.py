"""Peak memory while loading a bf16 checkpoint with ``--quantization int8`` / ``int4``, streamed or not.

    python -m benchmarks.quantized_load_memory [--shape llama-3.2-3b] [--shard-gib 2] [--methods int8 int4]

Writes a checkpoint of the given shape (random bf16 weights, in safetensors shards like a Hugging
Face upload) once, then loads it in a fresh process per method and mode and reads the process's memory:

- ``streamed``: the linears are quantized (int8, or packed int4 nibbles) from construction; each
  float tensor is quantized as it arrives (the format's ``quantize_on_load``);
- ``after loading``: the old road, a float32 model first, quantized once loaded.

For each: the final size of the weights as held (``worker.weight_bytes``), the peak anonymous
memory (sampled every 5 ms from /proc/self/status: the process's own allocations) and the kernel's
peak resident set (VmHWM, which also counts the checkpoint's memory-mapped pages: page cache the
kernel can drop, not memory the process owns).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-3b": dict(
        vocab_size=128256,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
}
GiB = 1 << 30


def write_checkpoint(path: Path, shape: dict[str, Any], shard_bytes: int) -> Path:
    """config.json and bf16 safetensors shards (with an index) of random weights."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**shape, architectures=["LlamaForCausalLM"], dtype="bfloat16", max_position_embeddings=4096)
    config.save_pretrained(str(path))
    with torch.device("meta"):
        names = {name: p.shape for name, p in LlamaForCausalLM(config).state_dict().items()}
    if shape.get("tie_word_embeddings"):
        names.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}

    def flush() -> None:
        file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard.clear()

    for name, size in names.items():
        shard[name] = (torch.randn(size, generator=gen) * size[-1] ** -0.5).to(torch.bfloat16)
        if sum(t.numel() * 2 for t in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field (VmHWM, RssAnon, ...) in KiB (0 when absent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure(model_dir: str, method: str, streamed: bool) -> dict[str, float]:
    """In this (fresh) process: load the model with ``method`` and report its memory."""
    import torch

    from pagedllm.config import EngineArgs
    from pagedllm.layers.quantization import QUANTIZATION_CONFIGS
    from pagedllm.models.loader import load_model
    from pagedllm.worker.worker import weight_bytes

    if not streamed:
        QUANTIZATION_CONFIGS[method].quantize_on_load = None  # the old road: quantize after loading
    arch = EngineArgs(model=model_dir, quantization=method).create_engine_config().model_config.arch
    peak_anon, done = [status_kib("RssAnon")], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak_anon[0] = max(peak_anon[0], status_kib("RssAnon"))

    base_anon = status_kib("RssAnon")
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    model = load_model(model_dir, arch, dtype=torch.float32, device=torch.device("cpu"), quantization=method)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return {
        "weights_gib": weight_bytes(model) / GiB,
        "peak_anon_gib": (peak_anon[0] - base_anon) * 1024 / GiB,
        "vm_hwm_gib": status_kib("VmHWM") * 1024 / GiB,
        "seconds": seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-3b")
    p.add_argument("--shard-gib", type=float, default=2.0)
    p.add_argument("--methods", nargs="+", choices=["int8", "int4"], default=["int8", "int4"])
    p.add_argument("--measure", nargs=3, metavar=("DIR", "METHOD", "MODE"), help=argparse.SUPPRESS)  # a child's job
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], args.measure[1], args.measure[2] == "streamed")))
        return
    from pagedllm.entrypoints.bench.common import env_line, environment

    with tempfile.TemporaryDirectory(prefix="quant-load-") as tmp:
        model_dir = write_checkpoint(Path(tmp) / "model", SHAPES[args.shape], int(args.shard_gib * GiB))
        on_disk = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / GiB
        rows = {}
        for method in args.methods:
            for mode in ("streamed", "after loading"):
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.quantized_load_memory",
                    "--measure",
                    str(model_dir),
                    method,
                    mode,
                ]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                rows[f"{method}, {mode}"] = json.loads(out.strip().splitlines()[-1])
    print(env_line(environment()))
    print(f"{args.shape}: bf16 checkpoint {on_disk:.2f} GiB in {args.shard_gib:g} GiB shards")
    print("| --quantization, mode | weights held GiB | peak anonymous GiB | vs weights | VmHWM GiB | load s |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        ratio = r["peak_anon_gib"] / r["weights_gib"]
        print(
            f"| {name} | {r['weights_gib']:.2f} | {r['peak_anon_gib']:.2f} | {ratio:.2f} | "
            f"{r['vm_hwm_gib']:.2f} | {r['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()
