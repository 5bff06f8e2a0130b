"""GET /v1/models and /v1/models/{id}."""

from __future__ import annotations

from fastapi import APIRouter

from pagedllm.entrypoints.openai.server_state import State

router = APIRouter()


@router.get("/v1/models")
async def list_models(state: State) -> dict:
    return {"object": "list", "data": [state.models.card(name) for name in state.models.all_names()]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(state: State, model_id: str) -> dict:
    return state.models.card(state.models.check(model_id))
