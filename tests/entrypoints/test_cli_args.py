"""The CLI is generated from the config dataclasses: every flag has a field and agrees with it
(default, choices, dest), every field has a flag, and the flags users have today keep their
names, short aliases and defaults."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedllm.config import ENGINE_TOPICS, EngineArgs, FrontendArgs
from pagedllm.config.choices import DTYPE_ALIASES, DTYPE_CHOICES, DTYPES
from pagedllm.config.options import option_info
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.cli_args import add_engine_args, add_server_args, engine_args_from_namespace

# The flags `pagedllm serve` had before the CLI was generated, with their defaults: none may
# change name, alias or default.
TODAYS_FLAGS = {
    "--tokenizer": None,
    "--served-model-name": None,
    "--dtype": "auto",
    "--quantization": None,
    "--max-model-len": None,
    "--block-size": 16,
    "--kv-cache-memory": None,
    "--gpu-memory-utilization": 0.9,
    "--max-num-seqs": 256,
    "--max-num-batched-tokens": None,
    "--long-prefill-token-threshold": 0,
    "--enable-prefix-caching": True,
    "--seed": 0,
    "--load-format": "auto",
    "--scheduling-policy": "fcfs",
    "--device": "auto",
    "--tensor-parallel-size": 1,
    "--data-parallel-size": 1,
    "--attention-backend": "auto",
    "--enforce-eager": False,
    "--trust-remote-code": False,
    "--structured-outputs-backend": "xgrammar",
    "--speculative-config": None,
    "--speculative-model": None,
    "--num-speculative-tokens": None,
    "--structured-outputs-compile-timeout": 30.0,
    "--host": "0.0.0.0",
    "--port": 8000,
    "--api-key": None,
    "--api-key-file": None,
    "--chat-template": None,
    "--enable-auto-tool-choice": False,
    "--tool-call-parser": None,
    "--uvicorn-log-level": "info",
    "--disable-uvicorn-access-log": False,
    "--shutdown-timeout": 30.0,
    "--max-waiting-requests": 1024,
}
ALIASES = {"-q": "--quantization", "-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size"}


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    add_engine_args(parser)
    return parser


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if not isinstance(a, argparse._HelpAction)}


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for cls in (EngineArgs, FrontendArgs) for f in dataclasses.fields(cls)}


def test_every_flag_has_a_field_and_every_field_a_flag() -> None:
    actions, fields = _actions(_serve_parser()), _fields()
    assert set(actions) == set(fields), set(actions) ^ set(fields)
    assert EngineArgs.field_names() == {f.name for topic in ENGINE_TOPICS for f in dataclasses.fields(topic)}


def test_flag_defaults_and_choices_agree_with_the_fields() -> None:
    for dest, action in _actions(_serve_parser()).items():
        f = _fields()[dest]
        info = option_info(f)
        assert action.default == f.default, dest
        assert (None if action.choices is None else tuple(action.choices)) == info.choices, dest
        if not info.positional:
            assert action.option_strings[0] == "--" + dest.replace("_", "-")
            assert tuple(action.option_strings[1:]) in (info.aliases, (f"--no-{dest.replace('_', '-')}",))


def test_parsing_nothing_gives_the_dataclass_defaults() -> None:
    ns = _serve_parser().parse_args([])
    assert engine_args_from_namespace(ns) == EngineArgs()
    assert {f.name: getattr(ns, f.name) for f in dataclasses.fields(FrontendArgs)} == dataclasses.asdict(FrontendArgs())


def test_todays_flags_keep_their_names_aliases_and_defaults() -> None:
    parser = _serve_parser()
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    for flag, default in TODAYS_FLAGS.items():
        assert flag in by_flag, flag
        assert by_flag[flag].default == default, flag
    for alias, flag in ALIASES.items():
        assert by_flag[alias] is by_flag[flag]
    ns = parser.parse_args(
        [
            "-q",
            "int8",
            "-tp",
            "1",
            "--no-enable-prefix-caching",
            "--api-key",
            "a",
            "--api-key",
            "b",
            "--served-model-name",
            "x",
            "y",
        ]
    )
    assert (ns.quantization, ns.tensor_parallel_size, ns.enable_prefix_caching) == ("int8", 1, False)
    assert (ns.api_key, ns.served_model_name) == (["a", "b"], ["x", "y"])
    assert engine_args_from_namespace(ns).served_model_name == "x"


def test_server_dest_names_the_server_reads() -> None:
    ns = _serve_parser().parse_args([])
    for name in (
        "host",
        "port",
        "api_key",
        "api_key_file",
        "chat_template",
        "enable_auto_tool_choice",
        "tool_call_parser",
        "uvicorn_log_level",
        "disable_uvicorn_access_log",
        "shutdown_timeout",
        "max_waiting_requests",
    ):
        assert hasattr(ns, name), name


def test_every_none_default_says_what_it_means() -> None:
    for name, f in _fields().items():
        if f.default is None:
            assert option_info(f).default_help, f"{name}: a None default needs default_help for --help"


def test_help_shows_each_flag_with_its_choices_and_default(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # unwrap argparse's line breaks
    for flag in TODAYS_FLAGS:
        assert flag in text, flag
    assert "{" + ",".join(DTYPE_CHOICES) + "}" in text
    assert "(default: 256)" in text and "(default: the model directory)" in text
    assert "(default: 4 GiB on CPU)" in text and "(default: on)" in text


@pytest.mark.parametrize("alias", sorted(DTYPE_ALIASES))
def test_dtype_accepts_every_alias_the_config_does(alias: str) -> None:
    """The drift this replaced: --dtype rejected fp16/fp32 that the config accepted."""
    ns = _serve_parser().parse_args(["--dtype", alias])
    assert engine_args_from_namespace(ns).dtype == alias
    assert set(DTYPE_CHOICES) == set(DTYPES) | set(DTYPE_ALIASES)


def test_generate_and_serve_take_the_model_as_positional(tmp_path) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", str(tmp_path)]).model == str(tmp_path)
    assert parser.parse_args(["generate", "--prompt", "hi", str(tmp_path)]).model == str(tmp_path)
    assert parser.parse_args(["serve"]).model is None


def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("bench", ["latency", "throughput", "prefix", "serve"])
def test_bench_engine_flags_are_the_config_fields(bench: str) -> None:
    """The benchmarks' engine flags come from the same fields: same type and choices as serve's,
    only the defaults a benchmark needs differ."""
    serve = _actions(_serve_parser())
    parser = _subparser(build_parser(), "bench", bench)
    shared = {dest: a for dest, a in _actions(parser).items() if dest in _fields() and dest != "model"}
    assert shared, "no engine flag found"
    for dest, action in shared.items():
        assert action.option_strings[0] == serve[dest].option_strings[0]
        assert list(action.choices or []) == list(serve[dest].choices or []), dest
        assert action.type == serve[dest].type, dest
    if "dtype" in shared:
        assert shared["dtype"].default == "float32"  # the bench's own default: the fastest on CPU
