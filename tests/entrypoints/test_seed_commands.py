"""Users' vLLM command lines, unchanged: the module entry points, ``--model`` beside the
positional model, and vLLM's ``--enable-chunked-prefill`` / ``--swap-space``."""

from __future__ import annotations

import logging

import httpx
import pytest

from pagedllm.config import CacheArgs, SchedulerArgs
from pagedllm.entrypoints.cli import build_parser, build_serve_parser
from pagedllm.entrypoints.cli_args import engine_args_from_namespace

from .openai.conftest import RemoteServer

MODULES = ["pagedllm.entrypoints.openai.api_server", "pagedllm.entrypoints.api_server"]


def test_model_as_flag_or_positional_or_both_when_equal(tmp_path) -> None:
    model = str(tmp_path)
    for argv in (["serve", model], ["serve", "--model", model], ["serve", "--model", model, model]):
        assert build_parser().parse_args(argv).model == model, argv
    ns = build_serve_parser("api_server").parse_args(["--model", model, "--served-model-name", "m"])
    assert engine_args_from_namespace(ns).model == model
    assert build_parser().parse_args(["generate", "--model", model]).model == model
    assert build_parser().parse_args(["serve"]).model is None


@pytest.mark.parametrize("argv", [["serve", "a", "--model", "b"], ["serve", "--model", "b", "a"]])
def test_model_given_twice_with_different_values_is_an_error(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert "given twice" in capsys.readouterr().err


def test_chunked_prefill_flags_are_accepted_and_the_help_says_it_is_always_on(capsys) -> None:
    parser = build_serve_parser("api_server")
    assert parser.parse_args(["--enable-chunked-prefill"]).enable_chunked_prefill is True
    assert parser.parse_args(["--no-enable-chunked-prefill"]).enable_chunked_prefill is False
    assert parser.parse_args(["--swap-space", "4"]).swap_space == 4.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "always on here" in text and "a second KV tier" in text


def test_no_chunked_prefill_only_warns_and_swap_space_sizes_a_tier(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        config = SchedulerArgs(enable_chunked_prefill=False).create_scheduler_config(256, "cpu", "serve")
        cache = CacheArgs(swap_space=4).create_cache_config("cpu")
    assert config == SchedulerArgs().create_scheduler_config(256, "cpu", "serve")  # nothing changes
    assert "chunked prefill is always on" in caplog.text and "swap" not in caplog.text
    assert cache.swap_space_bytes == 4 << 30
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        SchedulerArgs().create_scheduler_config(256, "cpu", "serve")
        CacheArgs().create_cache_config("cpu")
    assert not caplog.text  # the defaults say nothing
    with pytest.raises(ValueError, match="swap_space"):
        CacheArgs(swap_space=-1).create_cache_config("cpu")


@pytest.mark.parametrize("module", MODULES)
def test_module_entry_point_serves_with_model_flag(module, llama_model_dir) -> None:
    """``python -m pagedllm.entrypoints[.openai].api_server --model M ...`` as in vLLM recipes."""
    args = ["--served-model-name", "tiny", "--enable-chunked-prefill", "--swap-space", "4", "--max-model-len", "256"]
    with RemoteServer(llama_model_dir, args, entrypoint=[module], model_flag=True) as server:
        assert httpx.get(server.url_for("health"), timeout=10).status_code == 200
        r = httpx.post(
            server.url_for("v1", "completions"),
            json={"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "tiny" and body["usage"]["completion_tokens"] >= 1
        metrics = httpx.get(server.url_for("metrics"), timeout=10).text
        assert "vllm:gpu_cache_usage_perc{" in metrics and "vllm:time_per_output_token_seconds_count{" in metrics
        assert "swap tier: " in server.log()  # --swap-space sized a tier (the start-up capacity line)
