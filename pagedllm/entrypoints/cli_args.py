"""CLI flags generated from the config dataclasses' fields (vLLM's ``EngineArgs.add_cli_args`` idea).

A field ``max_model_len`` becomes ``--max-model-len`` with the field's default, choices and help
(``config/options.py``), its type from the annotation, and the same ``dest`` as the field's
name; so ``pagedllm serve --help`` shows what the code does. Booleans: a False default is a
``store_true`` switch, a True default a ``--flag / --no-flag`` pair. The positional field
(``model``) is also a flag (``--model``, vLLM's ``api_server`` spelling): give either, or both
with the same value.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from pagedllm.config import ENGINE_TOPICS, EngineArgs, FrontendArgs
from pagedllm.config.options import OptionInfo, flag_name, option_info

_TITLES = {
    "ModelArgs": "model",
    "LoadArgs": "load",
    "CacheArgs": "KV cache",
    "SchedulerArgs": "scheduler",
    "ParallelArgs": "parallelism",
    "DeviceArgs": "device",
    "StructuredOutputsArgs": "structured outputs",
    "SpeculativeArgs": "speculative decoding",
    "FrontendArgs": "server",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every :class:`EngineArgs` field as a flag (``model`` as the optional positional), one
    argument group per topic."""
    for topic in ENGINE_TOPICS:
        add_dataclass_args(parser, topic)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """HTTP-server flags of ``pagedllm serve``: the :class:`FrontendArgs` fields."""
    add_dataclass_args(parser, FrontendArgs)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argument group holding a flag for each field of the dataclass ``cls``."""
    group = parser.add_argument_group(_TITLES.get(cls.__name__, cls.__name__), cls.__doc__)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        info = option_info(f)
        names = [f.name] if info.positional else [flag_name(f.name), *info.aliases]
        kwargs = argparse_kwargs(f, info, hints[f.name])
        if info.positional:
            kwargs["action"] = _PositionalOrFlag
            flag_kwargs = {k: v for k, v in kwargs.items() if k not in ("nargs", "help")}
            flag_kwargs["help"] = f"the same as the positional {f.name.upper()} (vLLM's spelling)"
            group.add_argument(flag_name(f.name), dest=f.name, metavar=f.name.upper(), **flag_kwargs)
        group.add_argument(*names, **kwargs)


class _PositionalOrFlag(argparse.Action):
    """Stores a value given as the positional or as its ``--flag``: an absent positional (argparse
    passes its default) keeps what the flag set, and two different values are an error."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if values is None or values == self.default:
            return
        current = getattr(namespace, self.dest, self.default)
        if current not in (None, self.default, values):
            name = self.dest.upper()
            parser.error(
                f"{name} given twice, as the positional and as --{self.dest}, with different values: "
                f"{current!r} and {values!r}; give it once"
            )
        setattr(namespace, self.dest, values)


def add_engine_fields(
    group: argparse._ActionsContainer,
    names: list[str],
    defaults: dict[str, Any] | None = None,
    notes: dict[str, str] | None = None,
) -> None:
    """Flags for some :class:`EngineArgs` fields only (the benchmarks' engine flags): the same
    type, choices and help as ``serve``'s, with ``defaults`` overriding a field's default and
    ``notes`` appended to its help."""
    defaults, notes = defaults or {}, notes or {}
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    hints = typing.get_type_hints(EngineArgs)
    for name in names:
        f, info = fields[name], option_info(fields[name])
        kwargs = argparse_kwargs(f, info, hints[name])
        if name in defaults:
            kwargs["default"] = defaults[name]
            kwargs["help"] = f"{info.help} (default: {defaults[name]})".replace("%", "%%")
        if name in notes:
            kwargs["help"] += f"; {notes[name]}"
        group.add_argument(flag_name(name), **kwargs)


def argparse_kwargs(f: dataclasses.Field, info: OptionInfo, hint: Any) -> dict[str, Any]:
    """``add_argument`` keywords for one field: dest, default, type/action, choices, help."""
    kwargs: dict[str, Any] = {"default": f.default, "help": help_text(f, info)}
    if not info.positional:
        kwargs["dest"] = f.name
    base = _scalar_type(hint)
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        return kwargs
    if info.positional:
        kwargs["nargs"] = "?"
    for key in ("choices", "metavar", "nargs", "action"):
        if getattr(info, key) is not None:
            kwargs[key] = list(getattr(info, key)) if key == "choices" else getattr(info, key)
    if base is not str:
        kwargs["type"] = base
    return kwargs


def help_text(f: dataclasses.Field, info: OptionInfo) -> str:
    """The field's help with its default: the value itself, or what None means in words."""
    if info.default_help is not None:
        default = info.default_help
    elif isinstance(f.default, bool):
        default = "on" if f.default else "off"
    else:
        default = f"{f.default:g}" if isinstance(f.default, float) else str(f.default)
    return f"{info.help} (default: {default})".replace("%", "%%")  # argparse %-formats help


def _scalar_type(hint: Any) -> type:
    """bool, int or float if the annotation allows it (``int | None`` -> int), else str."""
    args = typing.get_args(hint) or (hint,)
    for candidate in (bool, int, float):
        if candidate in args:
            return candidate
    return str


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    names = EngineArgs.field_names()
    kwargs = {k: v for k, v in vars(ns).items() if k in names}
    served = kwargs.get("served_model_name")
    if isinstance(served, list):  # the engine reports the first name; the server answers to all
        kwargs["served_model_name"] = served[0] if served else None
    return EngineArgs(**kwargs)
