"""Write a dummy-weight model directory shaped like Llama-3-8B (bf16) for the H200 benchmarks.

Only ``config.json`` and the demo model's tokenizer files are written (no weights): pagedllm loads
the directory with ``--load-format dummy``, and the Hugging Face baseline builds the same config
with its own random init. The tokenizer is reused exactly as
``pagedllm.entrypoints.bench.common.write_dummy_model_dir`` does (token ids 0/1/2 = bos/eos/pad of
the demo tokenizer); benchmarks feed token ids and ignore EOS, so its small vocabulary does not
matter (run them with ``--disable-detokenize``).

    python3 benchmarks/gpu/make_llama3_8b_config.py /tmp/llama3-8b-shape
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

# Meta-Llama-3-8B's shape (not 3.1: plain RoPE, theta 500000, 8k context).
LLAMA3_8B_SHAPE: dict[str, Any] = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    attention_bias=False,
    mlp_bias=False,
    hidden_act="silu",
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,  # the demo tokenizer's ids, as write_dummy_model_dir does
)
ROPE_THETA = 500000.0
DESC = "dummy Llama-3-8B shape (random weights)"
# The same exclusions as common.write_dummy_model_dir (kept here too in case that private name moves).
_NOT_TOKENIZER_FILES = {"config.json", "generation_config.json", "model.safetensors", "README.md"}


def write_llama3_8b_dir(path: Path) -> Path:
    from transformers import LlamaConfig

    from pagedllm.demo.demo_model import ensure_demo_model

    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        **LLAMA3_8B_SHAPE,
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    )
    config.save_pretrained(str(path))
    for f in Path(ensure_demo_model()).iterdir():
        if f.is_file() and f.name not in _NOT_TOKENIZER_FILES:
            shutil.copy(f, path / f.name)
    check(path)
    return path


def check(path: Path) -> None:
    """What pagedllm and the bench cost model will read back must be the intended shape."""
    from pagedllm.entrypoints.bench import machine
    from pagedllm.hf_config import normalize_hf_config

    raw = json.loads((path / "config.json").read_text())
    arch = normalize_hf_config(raw)
    got = dict(
        hidden=arch.hidden_size,
        layers=arch.num_hidden_layers,
        heads=arch.num_attention_heads,
        kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        vocab=arch.vocab_size,
        theta=arch.rope.theta,
        tied=arch.tie_word_embeddings,
    )
    want = dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256, theta=ROPE_THETA, tied=False)
    if got != want:
        raise SystemExit(f"config.json reads back as {got}, expected {want}")
    cost = machine.model_cost({**raw.get("text_config", {}), **raw}, "bfloat16")
    print(
        f"wrote {path}: {DESC}; {cost.params / 1e9:.2f} B matmul params, "
        f"{cost.weight_bytes / 1e9:.2f} GB read per decode step, "
        f"KV {cost.kv_bytes_per_token // 1024} KiB/token (bf16)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="directory to write (created if missing)")
    args = p.parse_args(argv)
    write_llama3_8b_dir(Path(args.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
