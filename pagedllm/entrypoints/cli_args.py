"""Engine flags shared by every subcommand, spelled and defaulted as vLLM's."""

from __future__ import annotations

import argparse

from pagedllm.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    g.add_argument("--served-model-name", default=None, help="model name reported by the API (default: the model path)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float", "bf16"],
                   help="weight and activation dtype; auto = float32 on CPU, the checkpoint's dtype on GPU")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + output); default: the model's max_position_embeddings")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)")
    g.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV cache size in GiB on CPU (default 4, capped at what max_num_seqs full-length requests use)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory for weights, activations and KV cache on CUDA (default 0.9)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step (default 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step; longer prompts are chunked (default 2048)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes (default on)")
    g.add_argument("--seed", type=int, default=0, help="random seed for dummy weights and unseeded sampling")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="auto/safetensors: load weights; dummy: random weights from config.json (benchmarks)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs, or priority (lower value first; preempts the lowest priority)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="device (default: cuda if present)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="tensor-parallel ranks (only 1 for now)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow custom code from the model directory")


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    names = EngineArgs.field_names()
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})
