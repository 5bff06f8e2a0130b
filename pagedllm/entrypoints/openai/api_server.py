"""The OpenAI-compatible HTTP app: ``build_app(engine, args)``, the app factory.

It reads the server options, wires metrics, the API-key/overload gate (auth.py), the error
mapping (errors.py), the per-key quotas (quotas.py), the recent-error log the dashboard shows
(error_log.py) and the routers (routes/: completions, chat, invocations, tokenize, models, system,
dashboard; debug only with PAGEDLLM_DEBUG_ENDPOINTS=1), and shuts the engine down when the app stops. Running it as a process (socket, uvicorn,
signals, drain, the engine watchdog, exit codes) is ``server_process.py``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI

import pagedllm
from pagedllm import envs
from pagedllm.entrypoints.openai import openapi
from pagedllm.entrypoints.openai.auth import ServerGate
from pagedllm.entrypoints.openai.dashboard import DashboardStats
from pagedllm.entrypoints.openai.engine_client import EngineClient
from pagedllm.entrypoints.openai.error_log import ErrorRecorder
from pagedllm.entrypoints.openai.errors import add_exception_handlers
from pagedllm.entrypoints.openai.quotas import QuotaBook
from pagedllm.entrypoints.openai.routes import (
    chat,
    completions,
    dashboard,
    debug,
    embeddings,
    invocations,
    lora,
    models,
    responses,
    score,
    system,
    tokenize,
)
from pagedllm.entrypoints.openai.served_models import ServedModels
from pagedllm.entrypoints.openai.server_options import ServerOptions
from pagedllm.entrypoints.openai.server_state import ServerState
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embeddings import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore
from pagedllm.metrics.key_usage import KeyUsageMetrics
from pagedllm.metrics.prometheus import PrometheusStatLogger

ROUTERS = (
    completions.router,
    chat.router,
    responses.router,
    embeddings.router,
    score.router,
    invocations.router,
    tokenize.router,
    models.router,
    system.router,
    dashboard.router,
)


def build_app(engine: EngineClient, args: argparse.Namespace) -> FastAPI:
    """The FastAPI app serving ``engine``; the app shuts the engine down on exit."""
    options = ServerOptions.from_args(args)
    model_config = engine.config.model_config
    served = ServedModels(
        tuple(options.served_model_names), model_config.model, model_config.max_model_len, int(time.time())
    )
    for name, path in options.lora_modules:
        lora.add_lora_module(engine, served, name, path)
    registry = _metrics_registry(engine, served.names[0])
    state = ServerState(engine, options, served, registry, _load_handlers(engine, options, served))
    state.dashboard = DashboardStats(registry, state.errors, served.names[0])
    docs = not options.disable_fastapi_docs
    app = FastAPI(
        title="pagedllm",
        version=pagedllm.__version__,
        lifespan=_lifespan(state),
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.server_state = state
    max_load = options.admission_limit(engine.config.scheduler_config.max_num_seqs)
    app.add_middleware(
        ServerGate,
        api_keys=options.api_keys,
        max_load=max_load,
        engine_load=engine.get_num_unfinished_requests,
        counter=state,
        quotas=_quota_book(options, state.registry, served.names[0]),
    )
    app.add_middleware(ErrorRecorder, errors=state.errors)  # outermost: it sees the gate's 401s and 503s
    add_exception_handlers(app)
    routers = [*ROUTERS, *([debug.router] if envs.debug_endpoints() else [])]
    routers += [lora.router] if options.enable_lora_runtime_updates else []
    for router in routers:
        app.include_router(router)
    openapi.install(app, routers)
    return app


def _quota_book(options: ServerOptions, registry: Any, model_name: str) -> QuotaBook:
    """The per-key quotas, counting each key's usage in ``registry`` (no keys: nothing to count)."""
    if not options.api_keys:
        return QuotaBook()
    return QuotaBook(KeyUsageMetrics(registry, model_name, [key.name for key in options.api_keys]))


def _metrics_registry(engine: EngineClient, model_name: str) -> Any:
    """The registry of the engine's Prometheus logger (one is added if the engine has none)."""
    from pagedllm.config import EngineConfig

    for stat_logger in engine.stat_loggers:
        if isinstance(stat_logger, PrometheusStatLogger):
            return stat_logger.registry
    # Stand-in engines (tests) carry a partial config: their metrics keep the defaults.
    config = engine.config if isinstance(engine.config, EngineConfig) else None
    num_engines = config.parallel_config.data_parallel_size if config is not None else 1
    stat_logger = PrometheusStatLogger(model_name, config=config, num_engines=num_engines)
    if config is not None:
        stat_logger.log_engine_initialized(config, engine.capacity["num_blocks"])
    engine.stat_loggers.append(stat_logger)
    return stat_logger.registry


def _load_handlers(engine: EngineClient, options: ServerOptions, served: ServedModels) -> dict[str, Any]:
    """The endpoint handlers the generation routes delegate to (a kind missing here answers 501)."""
    if getattr(engine.config.model_config, "runner", "generate") == "pooling":  # stand-in engines: generate
        limit = options.prompt_limit(engine.config.scheduler_config.max_num_seqs)
        return {
            "embedding": OpenAIServingEmbedding(engine, served, prompt_limit=limit),
            "score": OpenAIServingScore(engine, served, prompt_limit=limit),
        }
    as_ids = options.return_tokens_as_token_ids
    chat = OpenAIServingChat(
        engine, served, options.chat_template, options.tool_call_parser, as_ids, options.trust_request_chat_template
    )
    return {
        "chat": chat,
        "completion": OpenAIServingCompletion(
            engine, served, as_ids, options.prompt_limit(engine.config.scheduler_config.max_num_seqs)
        ),
        "responses": OpenAIServingResponses(chat),
    }


def _lifespan(state: ServerState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            state.stop_engine()

    return lifespan


if __name__ == "__main__":  # vLLM's `python -m vllm.entrypoints.openai.api_server --model M`: `pagedllm serve`
    import sys

    from pagedllm.entrypoints import cli

    # The engine process is spawned and re-imports __main__ by its spec's name: name the light CLI
    # module, so it does not import this one (FastAPI, ~2 s) for nothing.
    sys.modules["__main__"].__spec__ = sys.modules[cli.__name__].__spec__
    sys.exit(cli.serve_main(prog="python -m pagedllm.entrypoints.openai.api_server"))
