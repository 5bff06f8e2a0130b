"""Speculative-decoding options: vLLM's spellings, and clear start-up errors for bad input."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from_namespace


def _config(model_dir, **kwargs):
    return EngineArgs(model=str(model_dir), max_model_len=256, **kwargs).create_engine_config().speculative_config


def test_off_by_default(llama_model_dir):
    assert _config(llama_model_dir) is None


def test_ngram_json_and_defaults(llama_model_dir):
    spec = _config(
        llama_model_dir,
        speculative_config=json.dumps(
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        ),
    )
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram",
        4,
        2,
        4,
    )
    assert spec.num_lookahead_tokens == 0
    assert spec.adaptive  # on by default
    spec = _config(
        llama_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1}
    )
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (1, 1)
    spec = _config(
        llama_model_dir, speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "adaptive": false}'
    )
    assert not spec.adaptive


def test_old_spellings(llama_model_dir, tiny_model_dir):
    spec = _config(llama_model_dir, speculative_model="[ngram]", num_speculative_tokens=3)
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    draft = tiny_model_dir("llama", seed=7, num_layers=1)
    spec = _config(llama_model_dir, speculative_model=str(draft), num_speculative_tokens=5)
    assert (spec.method, spec.draft_model, spec.num_lookahead_tokens) == ("draft_model", str(draft), 5)
    assert spec.draft_arch.num_hidden_layers == 1


def test_draft_kv_shares_the_block_budget(llama_model_dir):
    plain = EngineArgs(model=str(llama_model_dir), max_model_len=256).create_engine_config()
    spec = EngineArgs(
        model=str(llama_model_dir),
        max_model_len=256,
        speculative_config={"method": "draft_model", "model": str(llama_model_dir), "num_speculative_tokens": 4},
    ).create_engine_config()
    assert spec.kv_bytes_per_block() == 2 * plain.kv_bytes_per_block()
    assert spec.blocks_per_max_len_request() == plain.blocks_per_max_len_request() + 1  # lookahead


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"speculative_config": {"method": "medusa", "num_speculative_tokens": 2}}, "does not exist"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, "1..16"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 17}}, "1..16"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": "4"}}, "1..16"),
        ({"speculative_config": {"method": "ngram"}}, "num_speculative_tokens"),
        ({"speculative_config": {"num_speculative_tokens": 2}}, "needs a method"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}}, "unknown"),
        (
            {
                "speculative_config": {
                    "method": "ngram",
                    "num_speculative_tokens": 2,
                    "prompt_lookup_min": 5,
                    "prompt_lookup_max": 3,
                }
            },
            "must not exceed",
        ),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}}, "positive"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "adaptive": "no"}}, "true or false"),
        ({"speculative_config": "{not json"}, "not valid JSON"),
        ({"speculative_config": "[1, 2]"}, "JSON object"),
        ({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}}, 'needs "model"'),
        (
            {"speculative_config": {"method": "draft_model", "model": "/nonexistent", "num_speculative_tokens": 2}},
            "not a local directory",
        ),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}, "num_speculative_tokens": 3},
            "given twice",
        ),
    ],
)
def test_bad_options_fail_at_start_up(llama_model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _config(llama_model_dir, **kwargs)


def test_draft_with_another_vocabulary_is_rejected(llama_model_dir, tiny_model_dir):
    other = tiny_model_dir("llama", vocab_size=600)
    with pytest.raises(ValueError, match="vocabulary .* differs"):
        _config(llama_model_dir, speculative_model=str(other), num_speculative_tokens=2)


def test_draft_with_fewer_positions_is_rejected(llama_model_dir, tiny_model_dir):
    short = tiny_model_dir("llama", max_position_embeddings=128)
    with pytest.raises(ValueError, match="lower max_model_len"):
        _config(llama_model_dir, speculative_model=str(short), num_speculative_tokens=2)


def test_cli_flags(llama_model_dir):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    args = engine_args_from_namespace(ns)
    args.model, args.max_model_len = str(llama_model_dir), 256
    assert args.create_engine_config().speculative_config.num_speculative_tokens == 4
    ns = parser.parse_args(["--speculative-model", "[ngram]", "--num-speculative-tokens", "2"])
    assert (ns.speculative_model, ns.num_speculative_tokens) == ("[ngram]", 2)
