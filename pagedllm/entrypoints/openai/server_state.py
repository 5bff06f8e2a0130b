"""``ServerState``: what the routes share (engine, options, served models, handlers), and the
FastAPI dependency that hands it to them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from pagedllm.entrypoints.openai.engine_client import EngineClient
from pagedllm.entrypoints.openai.error_log import RecentErrors
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.served_models import ServedModels
from pagedllm.entrypoints.openai.server_options import ServerOptions

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.dashboard import DashboardStats
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion


@dataclass
class ServerState:
    engine: EngineClient
    options: ServerOptions
    models: ServedModels
    registry: Any  # the prometheus CollectorRegistry /metrics exports
    handlers: dict[str, Any] = field(default_factory=dict)  # "chat" / "completion": the endpoint classes
    engine_dead: bool = False  # set by the watchdog (server_process): /health answers 503
    exit_code: int = 0
    engine_stopped: bool = False  # shut down on purpose: not a death
    in_flight: int = 0  # generation requests inside the gate (auth.ServerGate keeps the count)
    errors: RecentErrors = field(default_factory=RecentErrors)  # the last 4xx/5xx (error_log.ErrorRecorder)
    dashboard: DashboardStats | None = None  # /dashboard/stats (set by build_app)

    def handler(self, kind: str) -> Any:
        if kind not in self.handlers:
            runner = getattr(self.engine.config.model_config, "runner", "generate")
            if _RUNNER_OF.get(kind, runner) != runner:
                raise OpenAIError(_wrong_runner_message(self.models.names[0], runner), 400)
            raise OpenAIError(f"{kind} completions are not implemented in this build", 501)
        return self.handlers[kind]

    def chat(self) -> OpenAIServingChat:
        return self.handler("chat")

    def completion(self) -> OpenAIServingCompletion:
        return self.handler("completion")

    def stop_engine(self) -> None:
        if not self.engine_stopped:
            self.engine_stopped = True
            self.engine.shutdown()


# Which runner serves each handler kind, and what each runner's server offers.
_RUNNER_OF = {
    "chat": "generate",
    "completion": "generate",
    "responses": "generate",
    "embedding": "pooling",
    "score": "pooling",
}
_ENDPOINTS = {
    "generate": "text generation (/v1/completions, /v1/chat/completions, /v1/responses)",
    "pooling": "embeddings (/v1/embeddings, /score, /rerank)",
}


def _wrong_runner_message(model: str, runner: str) -> str:
    other = "pooling" if runner == "generate" else "generate"
    return (
        f"The model `{model}` is served for {_ENDPOINTS[runner]} only; this endpoint needs a server started "
        f"with --runner {other}, which serves {_ENDPOINTS[other]}."
    )


def server_state(request: Request) -> ServerState:
    """FastAPI dependency: the state ``build_app`` attached to the app."""
    return request.app.state.server_state


State = Annotated[ServerState, Depends(server_state)]
