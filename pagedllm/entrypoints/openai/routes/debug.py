"""GET /debug/integrity: the engine's KV block pool integrity check, so tests of a server process
can end with it as tests of the offline engine do. Served only with PAGEDLLM_DEBUG_ENDPOINTS=1
(api_server.py), and behind the API key when keys are set."""

from __future__ import annotations

from fastapi import APIRouter

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.server_state import State

router = APIRouter()


@router.get("/debug/integrity")
async def integrity(state: State) -> dict:
    """200 ``{"integrity": "ok", "unfinished_requests": N}`` when every block is free, cached or
    held by a running request; else 500 naming what is wrong."""
    call_utility = getattr(state.engine, "call_utility", None)
    if call_utility is None:
        raise OpenAIError("this engine has no integrity check", 501)
    try:
        await call_utility("check_integrity")
    except RuntimeError as exc:
        raise OpenAIError(f"integrity check failed: {exc}", 500) from None
    return {"integrity": "ok", "unfinished_requests": state.engine.get_num_unfinished_requests()}
