"""Engine flags shared by every subcommand, spelled and defaulted as vLLM's."""

from __future__ import annotations

import argparse

from pagedllm.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) the API answers to; the first is reported in responses and metrics "
                        "(default: the model path as given, or pagedllm-demo)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float", "bf16"],
                   help="weight and activation dtype; auto = float32 on CPU, the checkpoint's dtype on GPU")
    g.add_argument("--quantization", "-q", default=None, choices=["int8"],
                   help="int8: weight-only int8 linear layers with per-channel scales (CPU, float32): a quarter "
                        "of the weight bytes, faster small-batch decode; the LM head stays float32 (default off)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + output); default: the model's max_position_embeddings")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)")
    g.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV cache size in GiB on CPU (default 4, capped at what max_num_seqs full-length requests use)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory for weights, activations and KV cache on CUDA (default 0.9)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step (default 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step; longer prompts are chunked (default 2048; 128 for "
                        "`serve` on CPU, where a bigger chunk stalls every stream for seconds)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="most prompt tokens one request computes per step (0 = only the step budget); "
                        "a cap keeps long prompts from stalling running decodes (lower inter-token latency)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes (default on)")
    g.add_argument("--seed", type=int, default=0, help="random seed for dummy weights and unseeded sampling (default 0)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="auto/safetensors: load weights; dummy: random weights from config.json (benchmarks)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs, or priority (lower value first; preempts the lowest priority)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="device (default: cuda if present)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="tensor-parallel ranks; accepted and validated, only 1 is supported for now (default 1)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="attention kernels: auto = triton on CUDA (when triton is installed), torch elsewhere")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly, without capturing CUDA graphs for decode batches "
                        "(faster start-up, slower decode)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow custom code from the model directory")
    g.add_argument("--structured-outputs-backend", default="xgrammar", choices=["xgrammar"],
                   help="grammar engine for JSON schema / regex / choice / grammar outputs (default xgrammar)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", '
                        '"model": DIR, "num_speculative_tokens": 4}\'; output is unchanged, only faster')
    g.add_argument("--speculative-model", default=None, metavar="DIR",
                   help='draft model directory for speculative decoding (same tokenizer), or "[ngram]" for '
                        "prompt lookup; use with --num-speculative-tokens")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens proposed per step with --speculative-model (1-16)")
    g.add_argument("--structured-outputs-compile-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a constraint that does not compile within this time is rejected (400) (default 30)")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """HTTP-server flags of ``pagedllm serve`` (names and defaults as vLLM's where it has them)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0: all IPv4 interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (repeatable; "
                        "/health, /metrics and /version stay open)")
    g.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="file with one accepted API key per line (blank lines and lines starting with # ignored)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_JINJA",
                   help="chat template for /v1/chat/completions: a file path or an inline Jinja string "
                        "(default: the tokenizer's own template)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let tool_choice "auto" (the default when a chat request has tools) parse tool calls out of '
                        "the model's text; needs --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>, Hermes/Qwen) or "
                        "llama3_json (a bare {\"name\", \"parameters\"} object, Llama 3.x)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of uvicorn (default info)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="do not log every HTTP request")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, stop accepting and let in-flight requests finish for up to this many "
                        "seconds before cancelling them (default 30)")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="admit at most max_num_seqs + this many generation requests at once; beyond that new "
                        "ones get 503 with a Retry-After header instead of queueing without bound (default 1024)")


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    names = EngineArgs.field_names()
    kwargs = {k: v for k, v in vars(ns).items() if k in names}
    served = kwargs.get("served_model_name")
    if isinstance(served, list):  # the engine reports the first name; the server answers to all
        kwargs["served_model_name"] = served[0] if served else None
    return EngineArgs(**kwargs)
