"""What the model runner does with the hidden states: ``PoolerArgs`` -> ``runner`` + ``PoolerConfig``.

``generate`` samples tokens; ``pooling`` turns each prompt's hidden states into one vector (an
embedding) and ends the request. ``auto`` picks pooling for models without an LM head (bare
decoders such as ``Qwen3Model``, encoders such as ``BertModel``), else generate. The pooling
method comes from the model's sentence-transformers files (``modules.json`` and its
``Pooling`` module's ``config.json``) where present, else the family's default (encoders: CLS,
decoders: LAST, normalized), and ``pooler_config`` overrides either. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.config.choices import RUNNERS, TASKS
from pagedllm.config.options import check_choice, option
from pagedllm.model_arch import POOLING_ONLY_ARCHITECTURES, ModelArchConfig
from pagedllm.pooling_params import POOLING_TYPES

# sentence-transformers' Pooling config keys -> our pooling types (the modes we implement).
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_ST_IGNORED_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling runner makes one vector of a prompt's final hidden states."""

    pooling_type: str  # LAST | MEAN | CLS
    normalize: bool  # the default when a request does not say
    hidden_size: int  # the embedding's full size (``dimensions`` may keep fewer)


@dataclass
class PoolerArgs:
    """Generate tokens or pool the prompt into an embedding."""

    runner: str = option(
        "auto",
        "generate: sample tokens (completions, chat); pooling: embed each prompt (/v1/embeddings, LLM.embed); "
        "auto: pooling for models without an LM head (e.g. BertModel, Qwen3Model), else generate",
        choices=RUNNERS,
    )
    task: str | None = option(
        None,
        "vLLM's older spelling of --runner: embed/embedding = pooling, generate, auto",
        choices=tuple(TASKS),
        default_help="--runner decides",
    )
    pooler_config: Any = option(
        None,
        'JSON overriding the pooling, e.g. \'{"pooling_type": "MEAN", "normalize": false}\' '
        "(pooling_type LAST, MEAN or CLS)",
        default_help="the model's sentence-transformers files, else CLS for encoders and LAST for decoders, normalized",
        metavar="JSON",
    )

    def resolve_runner(self, arch: ModelArchConfig) -> str:
        """generate or pooling; a generation runner on a model without an LM head is an error."""
        check_choice("runner", self.runner, RUNNERS)
        runner = self.runner
        if self.task is not None:
            check_choice("task", self.task, tuple(TASKS))
            runner = _merge_task(runner, TASKS[self.task])
        pooling_only = arch.architecture in POOLING_ONLY_ARCHITECTURES
        if runner == "auto":
            return "pooling" if pooling_only else "generate"
        if runner == "generate" and pooling_only:
            raise ValueError(
                f"{arch.architecture} has no language-model head, so it cannot generate text; "
                "serve it with --runner pooling (or leave --runner auto) for embeddings"
            )
        return runner

    def create_pooler_config(self, model_dir: str, arch: ModelArchConfig) -> PoolerConfig:
        """The pooling method: the model's files, then the family default, then ``pooler_config``."""
        pooling_type, normalize = read_sentence_transformers(Path(model_dir))
        if pooling_type is None:
            pooling_type = "CLS" if arch.encoder_only else "LAST"
        if normalize is None:
            normalize = True
        override = _parse_override(self.pooler_config)
        pooling_type = override.get("pooling_type", pooling_type)
        normalize = override.get("normalize", normalize)
        return PoolerConfig(pooling_type, normalize, arch.hidden_size)


def _merge_task(runner: str, from_task: str) -> str:
    if runner != "auto" and from_task != "auto" and runner != from_task:
        raise ValueError(f"--task names the {from_task} runner but --runner is {runner}; pass one of them")
    return from_task if from_task != "auto" else runner


def _parse_override(value: Any) -> dict[str, Any]:
    """``pooler_config`` as a dict (JSON text on the command line); unknown keys are errors."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f'pooler_config is not valid JSON ({e}); pass e.g. \'{{"pooling_type": "MEAN"}}\'') from e
    if not isinstance(value, dict):
        raise ValueError(f"pooler_config must be a JSON object, got {value!r}")
    unknown = set(value) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"pooler_config keys {sorted(unknown)} are not supported; use pooling_type and normalize")
    result = dict(value)
    if "pooling_type" in result:
        result["pooling_type"] = str(result["pooling_type"]).upper()
        check_choice("pooler_config pooling_type", result["pooling_type"], POOLING_TYPES)
    if "normalize" in result and not isinstance(result["normalize"], bool):
        raise ValueError(f"pooler_config normalize must be true or false, got {result['normalize']!r}")
    return result


def read_sentence_transformers(model_dir: Path) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from ``modules.json``; (None, None) when the model has none."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None, None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} must hold a list of modules")
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    unsupported = sorted(k for k in kinds if k not in _ST_IGNORED_MODULES)
    if unsupported:
        raise ValueError(
            f"{modules_file} lists sentence-transformers modules {unsupported} that pagedllm does not run "
            f"(it runs {', '.join(_ST_IGNORED_MODULES)}); the embeddings would differ from the model's"
        )
    pooling_type = None
    if "Pooling" in kinds:
        pooling_type = _st_pooling_type(model_dir / str(kinds["Pooling"].get("path", "1_Pooling")) / "config.json")
    return pooling_type, "Normalize" in kinds


def _st_pooling_type(config_file: Path) -> str:
    config = _read_json(config_file)
    unsupported = [k for k in _ST_UNSUPPORTED_MODES if config.get(k)]
    chosen = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    if unsupported or len(chosen) != 1:
        raise ValueError(
            f"{config_file} asks for pooling {unsupported + chosen or 'none'}; pagedllm pools with exactly one of "
            f"{', '.join(_ST_MODES)} (pass --pooler-config to choose one)"
        )
    return chosen[0]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
