"""The OpenAI-compatible HTTP server: the FastAPI app factory ``build_app``.

One uvicorn server runs in this process; the engine core runs in a child process (AsyncLLM).
Generation routes delegate to ``OpenAIServingChat`` / ``OpenAIServingCompletion``; this module
owns the rest: models, tokenize/detokenize, health, metrics, version, OpenAI-style error bodies,
and the API-key/overload gate (auth.py). The process lifecycle is in ``server_process.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.entrypoints.openai.auth import ServerGate, load_api_keys
from pagedllm.entrypoints.openai.errors import error_response
from pagedllm.metrics.prometheus import PrometheusStatLogger

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0  # /health answers 503 if the engine does not answer a ping within this
WATCHDOG_INTERVAL_S = 0.2  # how often the front end checks that the engine process is alive
DEAD_ENGINE_GRACE_S = 2.0  # after engine death, in-flight connections get this long to close


class OpenAIError(Exception):
    """Raise anywhere in a route to answer with an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


@dataclass
class ServerOptions:
    """Server flags, validated (ValueError with a message that says what to change)."""

    served_model_names: list[str]
    api_keys: list[str]
    chat_template: str | None
    max_waiting_requests: int
    tool_call_parser: str | None = None  # set: tool_choice "auto" parses calls in this format

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerOptions":
        names = getattr(args, "served_model_name", None) or [getattr(args, "model", None) or "pagedllm-demo"]
        waiting = getattr(args, "max_waiting_requests", 1024)
        if waiting < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {waiting}")
        keys = load_api_keys(getattr(args, "api_key", None), getattr(args, "api_key_file", None))
        return cls(list(names), keys, resolve_chat_template(getattr(args, "chat_template", None)), waiting,
                   _tool_call_parser(args))


def _tool_call_parser(args: argparse.Namespace) -> str | None:
    from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

    parser = getattr(args, "tool_call_parser", None)
    if not getattr(args, "enable_auto_tool_choice", False):
        return None
    if parser not in TOOL_PARSERS:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser, one of {', '.join(TOOL_PARSERS)}")
    return parser


def resolve_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file path, or an inline Jinja template."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor an inline Jinja template")


@dataclass
class ServerState:
    engine: Any  # AsyncLLM
    options: ServerOptions
    registry: Any  # prometheus CollectorRegistry
    created: int
    handlers: dict
    server: Any = None  # uvicorn.Server, set by run_server so the watchdog can stop it
    engine_dead: bool = False
    exit_code: int = 0
    engine_stopped: bool = False

    @property
    def max_model_len(self) -> int:
        return self.engine.config.model_config.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.options.served_model_names:
            raise OpenAIError(f"the model {model!r} does not exist; this server serves "
                              f"{', '.join(map(repr, self.options.served_model_names))}", 404, "model")

    def stop_engine(self) -> None:
        if not self.engine_stopped:
            self.engine_stopped = True
            self.engine.shutdown()


# ---------------------------------------------------------------------------------- app factory
def build_app(engine: Any, args: argparse.Namespace) -> FastAPI:
    """The FastAPI app for ``engine`` (an AsyncLLM). The app shuts the engine down on exit."""
    options = ServerOptions.from_args(args)
    state = ServerState(engine, options, _metrics_registry(engine, options.served_model_names[0]),
                        int(time.time()), _load_handlers(engine, options))
    app = FastAPI(title="pagedllm", version=pagedllm.__version__, lifespan=_lifespan(state))
    app.state.server_state = state
    max_load = engine.config.scheduler_config.max_num_seqs + options.max_waiting_requests
    app.add_middleware(ServerGate, api_keys=options.api_keys, max_load=max_load,
                       engine_load=engine.get_num_unfinished_requests)
    _add_exception_handlers(app)
    _add_generation_routes(app, state)
    _add_info_routes(app, state)
    _add_tokenizer_routes(app, state)
    return app


def _metrics_registry(engine: Any, model_name: str) -> Any:
    for stat_logger in engine.stat_loggers:
        if isinstance(stat_logger, PrometheusStatLogger):
            return stat_logger.registry
    stat_logger = PrometheusStatLogger(model_name)
    engine.stat_loggers.append(stat_logger)
    return stat_logger.registry


def _load_handlers(engine: Any, options: ServerOptions) -> dict:
    """The endpoint classes, imported here (lazily) so this module loads without them."""
    names = options.served_model_names
    handlers: dict = {}
    chat_cls = _optional_class("serving_chat", "OpenAIServingChat")
    if chat_cls is not None:
        handlers["chat"] = chat_cls(engine, names, options.chat_template, options.tool_call_parser)
    completion_cls = _optional_class("serving_completion", "OpenAIServingCompletion")
    if completion_cls is not None:
        handlers["completion"] = completion_cls(engine, names)
    return handlers


def _optional_class(module: str, name: str) -> Any:
    import importlib

    full = f"pagedllm.entrypoints.openai.{module}"
    try:
        return getattr(importlib.import_module(full), name)
    except ModuleNotFoundError as exc:
        if exc.name != full:  # a real missing dependency must not be hidden
            raise
        logger.warning("%s is not available: its route answers 501", full)
        return None


def _lifespan(state: ServerState):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        watchdog = asyncio.create_task(_watch_engine(state))
        try:
            yield
        finally:
            watchdog.cancel()
            state.stop_engine()

    return lifespan


async def _watch_engine(state: ServerState) -> None:
    """Engine death: fail in-flight requests, report not-ready, stop the server (exit code 1)."""
    while state.engine.is_running:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
    state.engine_dead = True
    state.exit_code = 1
    try:
        await state.engine.check_health()  # marks the engine dead: waiting clients get EngineDeadError
    except Exception as exc:
        logger.error("the engine core is gone (%s); shutting the server down", exc)
    server = state.server
    if server is not None:
        server.config.timeout_graceful_shutdown = min(server.config.timeout_graceful_shutdown or 0,
                                                      DEAD_ENGINE_GRACE_S)
        server.should_exit = True


# ---------------------------------------------------------------------------------- errors
def _add_exception_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineDeadError, _engine_dead)
    app.add_exception_handler(Exception, _internal_error)


async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc.message, exc.status, exc.param)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, status, param = validation_message(exc.errors())
    return error_response(message, status, param)


def validation_message(errors: Any) -> tuple[str, int, str | None]:
    """(message, 400, param) for pydantic errors: which field, and what is wrong with it."""
    errors = list(errors)
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "invalid JSON")
        return f"the request body is not valid JSON ({detail})", 400, None

    def where(e: dict) -> str:
        return ".".join(str(p) for p in e.get("loc", ()) if p != "body")

    parts = [f"{where(e) or 'body'}: {e.get('msg')}" for e in errors[:5]]
    return "invalid request: " + "; ".join(parts), 400, where(first) or None


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = {404: f"{request.method} {request.url.path} is not a route of this server",
               405: f"{request.url.path} does not accept {request.method}"}.get(exc.status_code, str(exc.detail))
    return error_response(message, exc.status_code, headers=getattr(exc, "headers", None))


async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
    return error_response(f"the engine is not running: {exc}", 500)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(f"internal server error ({type(exc).__name__}); see the server log", 500)


# ---------------------------------------------------------------------------------- routes
async def json_object_body(raw_request: Request) -> dict:
    """The request body as a JSON object, or a 400 OpenAIError that says what is wrong."""
    raw = await raw_request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise OpenAIError(f"the request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise OpenAIError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request) -> Response:
        body = await json_object_body(raw_request)
        return await _handler(state, "chat").create_chat_completion(body, raw_request)

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Response:
        body = await json_object_body(raw_request)
        return await _handler(state, "completion").create_completion(body, raw_request)


def _handler(state: ServerState, kind: str) -> Any:
    if kind not in state.handlers:
        raise OpenAIError(f"{kind} completions are not implemented in this build", 501)
    return state.handlers[kind]


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "pagedllm",
                "root": state.engine.config.model_config.model, "parent": None,
                "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [card(n) for n in state.options.served_model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict:
        state.check_model(model_id)
        return card(model_id)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/health")
    async def health() -> Response:
        if state.engine_dead:
            return error_response("the engine core process has died", 503)
        try:
            await asyncio.wait_for(state.engine.check_health(), HEALTH_TIMEOUT_S)
        except Exception as exc:
            return error_response(f"the engine is not answering ({type(exc).__name__}: {exc})", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def _add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> dict:
        request = _parse(TokenizeRequest, await json_object_body(raw_request))
        state.check_model(request.model)
        tokens = _tokenize(state, request)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> dict:
        request = _parse(DetokenizeRequest, await json_object_body(raw_request))
        state.check_model(request.model)
        vocab = state.engine.config.model_config.arch.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", 400, "tokens")
        return {"prompt": state.engine.tokenizer.decode(request.tokens)}


def _parse(model: type[BaseModel], body: dict) -> Any:
    """Validate a JSON body (any Content-Type, as the generation routes accept) into ``model``."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise OpenAIError(*validation_message(exc.errors())) from None


def _tokenize(state: ServerState, request: TokenizeRequest) -> list[int]:
    if (request.prompt is None) == (request.messages is None):
        raise OpenAIError("pass exactly one of 'prompt' (a string) or 'messages' (a chat)", 400, "prompt")
    tokenizer = state.engine.tokenizer
    if request.prompt is not None:
        special = True if request.add_special_tokens is None else request.add_special_tokens
        return tokenizer.encode(request.prompt, add_special_tokens=special)
    text = render_chat(tokenizer, request.messages, state.options.chat_template, request.add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens))


def render_chat(tokenizer: Any, messages: list[dict], template: str | None, add_generation_prompt: bool) -> str:
    """Apply the chat template (``--chat-template``, else the tokenizer's) to OpenAI messages."""
    convo = []
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise OpenAIError(f"messages[{i}] needs a string 'role'", 400, f"messages.{i}.role")
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        convo.append({**message, "content": content or ""})
    try:
        return tokenizer.apply_chat_template(convo, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # no template, or a template error: the user can fix either
        raise OpenAIError(f"could not apply the chat template ({type(exc).__name__}: {exc}); "
                          "pass --chat-template if the model has none", 400, "messages") from None
