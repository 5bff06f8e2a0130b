"""GET /dashboard (a self-contained HTML page) and GET /dashboard/stats (the JSON it polls each
second). The page holds no data and is open; with API keys set, /dashboard/stats needs one
(auth.py): the page asks for it in a field and sends it as a bearer token, never in the URL."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from pagedllm.entrypoints.openai.dashboard import for_tenant, page_html
from pagedllm.entrypoints.openai.server_state import State

router = APIRouter()


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    # no-store: the page is tiny and should follow the server's version.
    return HTMLResponse(page_html(), headers={"Cache-Control": "no-store"})


@router.get("/dashboard/stats")
async def dashboard_stats(state: State, request: Request) -> dict:
    """Requests, KV cache, prefix cache, token rates, latency percentiles, per-key usage and the
    recent errors: the same numbers /metrics exports, read at one moment. A key that is not an
    admin (``admin=1`` in the key file; ``--api-key`` keys are) sees its own usage only and no
    recent errors: those can hold other tenants' request contents."""
    assert state.dashboard is not None  # build_app sets it
    stats = state.dashboard.read(state.in_flight)
    key = getattr(request.state, "api_key", None)
    return stats if key is None or key.admin else for_tenant(stats, key.name)
