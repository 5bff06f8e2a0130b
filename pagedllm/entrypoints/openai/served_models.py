"""The model names this server answers to: the one model check every route uses.

With ``--enable-lora`` a request may name a LoRA adapter in ``model`` (``--lora-modules``, or one
loaded at run time with ``--enable-lora-runtime-updates``): the check resolves it, ``/v1/models``
lists it with the base model as its ``parent``, and requests in flight are counted per adapter so
an adapter in use cannot be unloaded.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.lora.request import LoRARequest


@dataclass(frozen=True)
class ServedModels:
    """``--served-model-name`` (the first is the one responses report), the model's card data and
    the adapters served by name."""

    names: tuple[str, ...]
    root: str  # the model directory
    max_model_len: int
    created: int  # unix time the server started
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # adapter name -> its request
    in_flight: Counter[str] = field(default_factory=Counter)  # adapter name -> requests running
    _ids: Any = field(default_factory=lambda: itertools.count(1))  # lora_int_id of each adapter added

    def check(self, requested: str | None) -> str:
        """The name to report for a request that asked for ``requested`` (None: the first served
        name); an OpenAI-style 404 naming the served names when this server does not serve it."""
        if requested is None:
            return self.names[0]
        if requested not in self.names and requested not in self.loras:
            served = ", ".join(f"`{name}`" for name in (*self.names, *self.loras))
            raise OpenAIError(f"The model `{requested}` does not exist; this server serves {served}.", 404, "model")
        return requested

    def lora_request(self, name: str) -> LoRARequest | None:
        """The adapter a (checked) model name runs with; None for the base model."""
        return self.loras.get(name)

    def new_lora(self, name: str, path: str) -> LoRARequest:
        """A request for a new adapter: a fresh ``lora_int_id`` each time (so a reloaded name never
        shares the old one's cached adapter or prefix-cache blocks). 400 if the name is taken."""
        if name in self.names or name in self.loras:
            raise OpenAIError(f"The model name `{name}` is already served; unload it first or pick another", 400)
        return LoRARequest(name, next(self._ids), path)

    def add_lora(self, lora: LoRARequest) -> None:
        self.loras[lora.lora_name] = lora

    def remove_lora(self, name: str) -> None:
        """Forget an adapter: 404 when unknown, 409 while requests use it."""
        if name not in self.loras:
            raise OpenAIError(
                f"The LoRA adapter `{name}` is not loaded; loaded: {sorted(self.loras)}", 404, "lora_name"
            )
        if self.in_flight[name]:
            raise OpenAIError(
                f"The LoRA adapter `{name}` has {self.in_flight[name]} requests in flight; unload it when they finish",
                409,
                "lora_name",
            )
        del self.loras[name]
        self.in_flight.pop(name, None)

    async def tracked(self, name: str, outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``outputs``, counted as in flight for adapter ``name`` while they stream."""
        self.in_flight[name] += 1
        try:
            async for item in outputs:
                yield item
        finally:
            self.in_flight[name] -= 1

    def card(self, name: str) -> dict:
        """The ``/v1/models`` entry of one served name or adapter (its ``parent``: the base model)."""
        lora = self.loras.get(name)
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedllm",
            "root": self.root if lora is None else lora.lora_path,
            "parent": None if lora is None else self.names[0],
            "max_model_len": self.max_model_len,
        }

    def all_names(self) -> list[str]:
        return [*self.names, *self.loras]
