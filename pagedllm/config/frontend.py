"""``pagedllm serve``'s HTTP-server options (names and defaults as vLLM's where it has them).

Like the engine's, each flag is generated from a field here; the server reads the parsed values
(``args.api_key``, ``args.chat_template``, ...) and validates them in ``ServerOptions``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config.choices import TOOL_CALL_PARSERS, UVICORN_LOG_LEVELS
from pagedllm.config.options import option


@dataclass
class FrontendArgs:
    """The OpenAI-compatible server's flags."""

    host: str = option("0.0.0.0", "address to bind (0.0.0.0: all IPv4 interfaces)")
    port: int = option(8000, "port to listen on")
    api_key: list[str] | None = option(
        None,
        "require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and the API docs (/docs, "
        "/redoc, /openapi.json) (repeatable; /health, /metrics and /version stay open)",
        default_help="no key required",
        metavar="KEY",
        action="append",
    )
    api_key_file: str | None = option(
        None,
        "file with one accepted API key per line (blank lines and lines starting with # ignored), "
        "optionally with per-key settings after it: 'KEY name=NAME rpm=N tpm=N max_concurrent=N priority=N' "
        "(limits per minute / in flight; over one: 429 + Retry-After; see README)",
        default_help="none",
        metavar="FILE",
    )
    chat_template: str | None = option(
        None,
        "chat template for /v1/chat/completions: a file path or an inline Jinja string",
        default_help="the tokenizer's own template",
        metavar="FILE_OR_JINJA",
    )
    enable_auto_tool_choice: bool = option(
        False,
        'let tool_choice "auto" (the default when a chat request has tools) parse tool calls out of '
        "the model's text; needs --tool-call-parser",
    )
    tool_call_parser: str | None = option(
        None,
        "the model's tool-call format: hermes (<tool_call>{...}</tool_call>, Hermes/Qwen) or llama3_json "
        '(a bare {"name", "parameters"} object, Llama 3.x)',
        choices=TOOL_CALL_PARSERS,
        default_help="none",
    )
    trust_request_chat_template: bool = option(
        False,
        "accept a chat_template field in requests (chat completions, /tokenize); off, such a request "
        "is refused, since a template is code the server runs",
    )
    return_tokens_as_token_ids: bool = option(
        False,
        "render tokens in logprobs as 'token_id:N' by default (a request's return_tokens_as_token_ids "
        "overrides it), so clients can map tokens that are not valid UTF-8 on their own",
    )
    enable_tokenizer_info_endpoint: bool = option(
        False, "serve GET /tokenizer_info: the tokenizer's configuration and chat template"
    )
    enable_server_load_tracking: bool = option(
        False, "count generation requests in flight and report them on GET /load (otherwise it reads 0)"
    )
    uvicorn_log_level: str = option("info", "log level of uvicorn", choices=UVICORN_LOG_LEVELS)
    disable_uvicorn_access_log: bool = option(False, "do not log every HTTP request")
    shutdown_timeout: float = option(
        30.0,
        "on SIGTERM/SIGINT, stop accepting and let in-flight requests finish for up to this many seconds "
        "before cancelling them",
        metavar="SECONDS",
    )
    lora_modules: list[str] | None = option(
        None,
        "LoRA adapters served by name (needs --enable-lora): NAME=PATH, or vLLM's JSON "
        '\'{"name": NAME, "path": PATH}\'; a request names one in its model field',
        default_help="none",
        metavar="NAME=PATH",
        nargs="+",
    )
    enable_lora_runtime_updates: bool = option(
        False,
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    max_waiting_requests: int = option(
        1024,
        "admit at most max_num_seqs + this many generation requests at once; beyond that new ones get 503 "
        "with a Retry-After header instead of queueing without bound",
    )
    max_prompts_per_request: int = option(
        256,
        "most prompts one /v1/completions request may carry (a list of strings or of token lists); more is "
        "a 400. Each prompt is an engine request, so the limit is also held to half of max_num_seqs + "
        "--max-waiting-requests: one client's batch never fills the admission limit alone",
        metavar="N",
    )
    max_request_body_bytes: int = option(
        32 * 1024 * 1024,
        "largest request body accepted, checked from Content-Length and while the body streams in; "
        "a larger one is refused with 413",
        metavar="BYTES",
    )
    timeout_keep_alive: int = option(
        5, "close an idle keep-alive connection after this many seconds (uvicorn's)", metavar="SECONDS"
    )
    header_read_timeout: float = option(
        20.0,
        "close a connection whose request line and headers have not all arrived this many seconds after "
        "the connection opened or its previous response (slow-header clients hold no connection forever)",
        metavar="SECONDS",
    )
    body_read_timeout: float = option(
        30.0,
        "answer 408 to a request whose body has not all arrived this many seconds after its headers "
        "(slow-body clients hold no admission slot forever)",
        metavar="SECONDS",
    )
    disable_fastapi_docs: bool = option(
        False, "do not serve /docs, /redoc and /openapi.json (with --api-key they need the key)"
    )
