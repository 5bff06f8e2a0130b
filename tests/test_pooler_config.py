"""The runner and pooling method: --runner/--task, sentence-transformers files, --pooler-config."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedllm.config.pooler import PoolerArgs, read_sentence_transformers
from pagedllm.model_arch import ModelArchConfig, RopeConfig


def _arch(architecture: str = "LlamaForCausalLM", encoder_only: bool = False) -> ModelArchConfig:
    return ModelArchConfig(
        architecture, "llama", 100, 32, 64, 2, 4, 4, 8, 128, 1e-5, RopeConfig(), encoder_only=encoder_only
    )


def _st_files(tmp_path, pooling: dict, modules: tuple[str, ...] = ("Transformer", "Pooling", "Normalize")):
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    entries = [
        {"idx": i, "name": str(i), "path": paths[m], "type": f"sentence_transformers.models.{m}"}
        for i, m in enumerate(modules)
    ]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))
    return tmp_path


@pytest.mark.parametrize(
    ("architecture", "runner", "task", "expected"),
    [
        ("LlamaForCausalLM", "auto", None, "generate"),
        ("Qwen3Model", "auto", None, "pooling"),
        ("BertModel", "auto", None, "pooling"),
        ("LlamaForCausalLM", "pooling", None, "pooling"),
        ("LlamaForCausalLM", "auto", "embed", "pooling"),
        ("LlamaForCausalLM", "auto", "embedding", "pooling"),
        ("LlamaForCausalLM", "generate", "generate", "generate"),
    ],
)
def test_runner_resolution(architecture, runner, task, expected):
    assert PoolerArgs(runner=runner, task=task).resolve_runner(_arch(architecture)) == expected


def test_runner_errors_say_what_to_change():
    with pytest.raises(ValueError, match="no language-model head.*--runner pooling"):
        PoolerArgs(runner="generate").resolve_runner(_arch("BertModel"))
    with pytest.raises(ValueError, match="pass one of them"):
        PoolerArgs(runner="generate", task="embed").resolve_runner(_arch())
    with pytest.raises(ValueError, match="runner must be one of"):
        PoolerArgs(runner="classify").resolve_runner(_arch())


def test_family_defaults_without_files(tmp_path):
    decoder = PoolerArgs().create_pooler_config(str(tmp_path), _arch())
    encoder = PoolerArgs().create_pooler_config(str(tmp_path), _arch("BertModel", encoder_only=True))
    assert (decoder.pooling_type, decoder.normalize, decoder.hidden_size) == ("LAST", True, 32)
    assert (encoder.pooling_type, encoder.normalize) == ("CLS", True)


@pytest.mark.parametrize(
    ("key", "expected"),
    [("pooling_mode_mean_tokens", "MEAN"), ("pooling_mode_cls_token", "CLS"), ("pooling_mode_lasttoken", "LAST")],
)
def test_sentence_transformers_pooling(tmp_path, key, expected):
    model_dir = _st_files(tmp_path, {key: True})
    assert read_sentence_transformers(model_dir) == (expected, True)


def test_sentence_transformers_without_normalize_and_override(tmp_path):
    model_dir = _st_files(tmp_path, {"pooling_mode_mean_tokens": True}, ("Transformer", "Pooling"))
    assert read_sentence_transformers(model_dir) == ("MEAN", False)
    config = PoolerArgs(pooler_config={"pooling_type": "cls"}).create_pooler_config(str(model_dir), _arch())
    assert (config.pooling_type, config.normalize) == ("CLS", False)


def test_unsupported_sentence_transformers_setups_are_errors(tmp_path):
    with pytest.raises(ValueError, match="Dense"):
        read_sentence_transformers(_st_files(tmp_path / "a", {"pooling_mode_mean_tokens": True}, ("Pooling", "Dense")))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_sentence_transformers(_st_files(tmp_path / "b", {"pooling_mode_max_tokens": True}))


@pytest.fixture(autouse=True)
def _make_dirs(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("{not json", "not valid JSON"),
        ('["MEAN"]', "JSON object"),
        ('{"pooling": "MEAN"}', "not supported"),
        ('{"pooling_type": "MAX"}', "pooling_type must be one of"),
        ('{"normalize": "yes"}', "true or false"),
    ],
)
def test_bad_pooler_config(tmp_path, value, match):
    with pytest.raises(ValueError, match=match):
        PoolerArgs(pooler_config=value).create_pooler_config(str(tmp_path), _arch())


def test_pooling_params_validation():
    from pagedllm.pooling_params import PoolingParams

    assert PoolingParams(dimensions=4).needs_every_position is False  # LAST by default
    assert dataclasses.replace(PoolingParams(), pooling_type="MEAN").needs_every_position
    for bad in ({"dimensions": 0}, {"normalize": "no"}, {"truncate_prompt_tokens": 0}, {"truncation_side": "up"}):
        with pytest.raises(ValueError):
            PoolingParams(**bad)
