"""GET /health (and SageMaker's /ping), /load, /metrics and /version: open without an API key
(auth.py), for probes, load balancers and scrapers."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import pagedllm
from pagedllm.entrypoints.openai.errors import error_response
from pagedllm.entrypoints.openai.server_state import State

HEALTH_TIMEOUT_S = 5.0  # /health answers 503 if the engine does not answer a ping within this

router = APIRouter()


@router.get("/health")
@router.get("/ping")
@router.post("/ping")
async def health(state: State) -> Response:
    """200 when the engine answers, else 503 (what a load balancer's readiness probe reads)."""
    if state.engine_dead:
        return error_response("the engine core process has died", 503)
    try:
        await asyncio.wait_for(state.engine.check_health(), HEALTH_TIMEOUT_S)
    except Exception as exc:
        return error_response(f"the engine is not answering ({type(exc).__name__}: {exc})", 503)
    return Response(status_code=200)


@router.get("/load")
async def load(state: State) -> dict:
    """Generation requests in flight (with --enable-server-load-tracking; else 0, as vLLM)."""
    return {"server_load": state.in_flight if state.options.enable_server_load_tracking else 0}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version() -> dict:
    return {"version": pagedllm.__version__}
