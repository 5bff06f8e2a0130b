"""One dataclass field per setting: its default, choices and help in the field's metadata.

``option()`` declares a setting once; the CLI (``entrypoints/cli_args.py``) generates its flag
from the field, and the validators below read the same choices, so ``pagedllm serve --help``
cannot disagree with the code. Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GiB = 1 << 30
_KEY = "pagedllm.option"


@dataclass(frozen=True)
class OptionInfo:
    """How one field appears on the command line."""

    help: str
    choices: tuple[str, ...] | None = None
    # What a None default means, in words ("the model directory"); shown as the flag's default.
    default_help: str | None = None
    aliases: tuple[str, ...] = ()  # short flags, e.g. ("-q",)
    metavar: str | None = None
    nargs: str | None = None  # "+" takes a list on the CLI (the field keeps the first item)
    action: str | None = None  # "append": repeatable flag, the field holds a list
    positional: bool = False  # the command's positional argument (``pagedllm serve MODEL``)


def option(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | None = None,
    default_help: str | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    nargs: str | None = None,
    action: str | None = None,
    positional: bool = False,
) -> Any:
    """A dataclass field with a default and its :class:`OptionInfo`."""
    info = OptionInfo(
        help, tuple(choices) if choices is not None else None, default_help, aliases, metavar, nargs, action, positional
    )
    return dataclasses.field(default=default, metadata={_KEY: info})


def option_info(f: dataclasses.Field) -> OptionInfo:
    """The :class:`OptionInfo` of a field declared with :func:`option`."""
    info = f.metadata.get(_KEY)
    if info is None:
        raise TypeError(f"field {f.name!r} is not declared with config.options.option()")
    return info


def flag_name(name: str) -> str:
    """The CLI spelling of a field: ``max_model_len`` -> ``--max-model-len``."""
    return "--" + name.replace("_", "-")


def check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
