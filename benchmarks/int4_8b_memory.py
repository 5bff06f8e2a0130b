"""A Llama-3-8B-shaped 4-bit (AWQ layout) model with its KV cache on a 24 GB machine.

    python -m benchmarks.int4_8b_memory [--kv-gib 4] [--tokens 8]

Writes config.json for the Llama-3-8B shape with an AWQ ``quantization_config`` (group 128) and
the demo tokenizer, then serves it offline with random weights (``load_format="dummy"``: the
packed int32 words are random bits, so the text is noise; this measures memory and speed). The
checkpoint's int4 words are allocated packed and repacked per layer into the int4 kernel's
layout, so no float copy of the linears exists. Reported: the weights as held, the KV pool, the
process's peak resident set (VmHWM) against the machine's memory, and batch-1 decode tokens/s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.gpu.make_llama3_8b_config import LLAMA3_8B_SHAPE
from benchmarks.quantized_load_memory import status_kib

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GiB = 1 << 30


def write_model_dir(path: Path) -> Path:
    from pagedllm.entrypoints.bench.common import write_dummy_model_dir

    write_dummy_model_dir(path)  # the demo tokenizer files; config.json is replaced below
    config = json.loads((path / "config.json").read_text())
    for key in ("num_key_value_heads", "head_dim"):
        config.pop(key, None)
    config.update(LLAMA3_8B_SHAPE, quantization_config=AWQ, torch_dtype="float16")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-gib", type=float, default=4.0)
    p.add_argument("--tokens", type=int, default=8)
    args = p.parse_args()
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.bench.common import env_line, environment
    from pagedllm.worker.worker import weight_bytes

    with tempfile.TemporaryDirectory(prefix="int4-8b-") as tmp:
        model_dir = write_model_dir(Path(tmp) / "model")
        start = time.perf_counter()
        llm = LLM(str(model_dir), load_format="dummy", max_model_len=4096, kv_cache_memory=args.kv_gib)
        ready = time.perf_counter() - start
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    weights = weight_bytes(runner.model) / GiB
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
    per_token = (time.perf_counter() - start) / args.tokens
    total = int(Path("/proc/meminfo").read_text().split()[1]) * 1024 / GiB
    print(env_line(environment()))
    print(
        "| model | weights held GiB | KV cache GiB | peak RSS (VmHWM) GiB | machine GiB | ready s | batch-1 s/token |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| Llama-3-8B shape, AWQ 4-bit (dummy) | {weights:.2f} | {args.kv_gib:g} | {status_kib('VmHWM') / (1 << 20):.2f} "
        f"| {total:.1f} | {ready:.1f} | {per_token:.2f} |"
    )


if __name__ == "__main__":
    main()
