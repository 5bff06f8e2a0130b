"""LoRA adapters on the server: ``--lora-modules`` checked at start-up, and (with
``--enable-lora-runtime-updates``) POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

An adapter is checked in the front end (its files, rank, target modules and shapes against the
base model): a bad one is a start-up error or a 400 naming it, never a failure in an engine step.
The engine process loads it by path the first time a request uses it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from pagedllm.entrypoints.openai.engine_client import EngineClient
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel
from pagedllm.entrypoints.openai.request_body import typed_body
from pagedllm.entrypoints.openai.served_models import ServedModels
from pagedllm.entrypoints.openai.server_state import State

router = APIRouter()


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: int | None = None  # accepted as vLLM does; the name decides


def add_lora_module(engine: EngineClient, served: ServedModels, name: str, path: str) -> None:
    """Check the adapter against the engine's base model and serve it as ``name`` (ValueError
    naming it when it does not fit)."""
    lora = served.new_lora(name, path)
    engine.check_lora(lora)
    served.add_lora(lora)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(
    state: State, request: Annotated[LoadLoRAAdapterRequest, typed_body(LoadLoRAAdapterRequest)]
) -> PlainTextResponse:
    try:
        add_lora_module(state.engine, state.models, request.lora_name, request.lora_path)
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    state: State, request: Annotated[UnloadLoRAAdapterRequest, typed_body(UnloadLoRAAdapterRequest)]
) -> PlainTextResponse:
    state.models.remove_lora(request.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
