"""The model names this server answers to: the one model check every route uses."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.entrypoints.openai.errors import OpenAIError


@dataclass(frozen=True)
class ServedModels:
    """``--served-model-name`` (the first is the one responses report) and the model's card data."""

    names: tuple[str, ...]
    root: str  # the model directory
    max_model_len: int
    created: int  # unix time the server started

    def check(self, requested: str | None) -> str:
        """The name to report for a request that asked for ``requested`` (None: the first served
        name); an OpenAI-style 404 naming the served names when this server does not serve it."""
        if requested is None:
            return self.names[0]
        if requested not in self.names:
            served = ", ".join(f"`{name}`" for name in self.names)
            raise OpenAIError(f"The model `{requested}` does not exist; this server serves {served}.", 404, "model")
        return requested

    def card(self, name: str) -> dict:
        """The ``/v1/models`` entry of one served name."""
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedllm",
            "root": self.root,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
