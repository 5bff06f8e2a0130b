"""The ``pagedllm`` command: ``serve``, ``generate`` and ``bench`` subcommands."""

from __future__ import annotations

import argparse
import sys

from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from_namespace


def _generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    llm = LLM(**vars(engine_args_from_namespace(args)))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)
    prompts = args.prompt or ["Hello, my name is"]
    for out in llm.generate(prompts, params, use_tqdm=False):
        print(f"--- prompt: {out.prompt!r}\n{out.outputs[0].text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: paged-KV LLM inference and serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline for a few prompts",
                         description="Generate text for the given prompts with the offline engine.")
    gen.add_argument("model", nargs="?", default=None,
                     help="local Hugging Face-format model directory (default: the built-in random-weight demo model)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default 0)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
