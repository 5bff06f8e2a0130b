"""The server's own flags (``pagedllm serve``), read from the parsed arguments and validated."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from pagedllm.entrypoints.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.api_keys import ApiKey, load_api_keys
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS


@dataclass(frozen=True)
class HttpLimits:
    """What one client may ask of the server: prompts and bytes per request, and how long a
    connection may sit idle or half-sent (all > 0)."""

    max_prompts_per_request: int = 256
    max_request_body_bytes: int = 32 * 1024 * 1024
    timeout_keep_alive: int = 5
    header_read_timeout: float = 20.0
    body_read_timeout: float = 30.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpLimits:
        values = {f: getattr(args, f, getattr(cls, f)) for f in cls.__dataclass_fields__}
        for name, value in values.items():
            if not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        return cls(**values)


@dataclass
class ServerOptions:
    """Server flags, validated (ValueError with a message that says what to change)."""

    served_model_names: list[str]
    api_keys: list[ApiKey]  # with their names and limits (api_keys.py)
    chat_template: str | None  # the template itself (--chat-template read), None: the tokenizer's
    max_waiting_requests: int
    tool_call_parser: str | None = None  # set: tool_choice "auto" parses calls in this format
    trust_request_chat_template: bool = False
    return_tokens_as_token_ids: bool = False
    enable_tokenizer_info_endpoint: bool = False
    enable_server_load_tracking: bool = False
    disable_fastapi_docs: bool = False
    limits: HttpLimits = field(default_factory=HttpLimits)

    def admission_limit(self, max_num_seqs: int) -> int:
        """Generation requests admitted at once (auth.ServerGate); more get 503."""
        return max_num_seqs + self.max_waiting_requests

    def prompt_limit(self, max_num_seqs: int) -> tuple[int, str]:
        """The most prompts one completion request may carry, and why: --max-prompts-per-request,
        held to half the admission limit, since each prompt is an engine request and the gate
        counts them: one client's allowed batch must leave room for the others."""
        flag = self.limits.max_prompts_per_request
        admitted = self.admission_limit(max_num_seqs)
        if flag <= max(1, admitted // 2):
            return flag, f"--max-prompts-per-request {flag}"
        return max(1, admitted // 2), (
            f"--max-prompts-per-request {flag}, held to half the {admitted} requests this server admits "
            "at once (--max-num-seqs + --max-waiting-requests)"
        )

    enable_lora_runtime_updates: bool = False
    lora_modules: list[tuple[str, str]] = field(default_factory=list)  # (name, path), checked at start-up

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerOptions:
        names = getattr(args, "served_model_name", None) or [getattr(args, "model", None) or "pagedllm-demo"]
        waiting = getattr(args, "max_waiting_requests", 1024)
        if waiting < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {waiting}")
        keys = load_api_keys(getattr(args, "api_key", None), getattr(args, "api_key_file", None))
        return cls(
            list(names),
            keys,
            load_chat_template(getattr(args, "chat_template", None)),
            waiting,
            _tool_call_parser(args),
            **{name: bool(getattr(args, name, False)) for name in _SWITCHES},
            limits=HttpLimits.from_args(args),
            lora_modules=_lora_modules(args),
        )


_SWITCHES = (
    "trust_request_chat_template",
    "return_tokens_as_token_ids",
    "enable_tokenizer_info_endpoint",
    "enable_server_load_tracking",
    "disable_fastapi_docs",
    "enable_lora_runtime_updates",
)


def _lora_modules(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``--lora-modules`` as (name, path) pairs: NAME=PATH or '{"name": ..., "path": ...}'."""
    modules = [_lora_module(item) for item in getattr(args, "lora_modules", None) or []]
    if (modules or getattr(args, "enable_lora_runtime_updates", False)) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules and --enable-lora-runtime-updates need --enable-lora")
    return modules


def _lora_module(item: str) -> tuple[str, str]:
    if item.lstrip().startswith("{"):
        try:
            spec = json.loads(item)
            return str(spec["name"]), str(spec["path"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f'--lora-modules {item!r}: a JSON module needs "name" and "path"') from None
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {item!r}: write NAME=PATH (the adapter's name and its directory)")
    return name, path


def _tool_call_parser(args: argparse.Namespace) -> str | None:
    parser = getattr(args, "tool_call_parser", None)
    if not getattr(args, "enable_auto_tool_choice", False):
        return None
    if parser not in TOOL_PARSERS:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser, one of {', '.join(TOOL_PARSERS)}")
    return parser
