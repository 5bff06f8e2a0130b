"""PoolingParams: what a pooling (embedding) request asks for (torch-free, vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingParams:
    """Options of one embedding request.

    * ``dimensions``: keep the first ``dimensions`` values of the embedding (Matryoshka
      truncation); with normalization on, the kept part is normalized again. None: all.
    * ``normalize``: L2-normalize the embedding; None takes the model's default (its
      sentence-transformers ``Normalize`` module, or on when the model has no such files).
    * ``truncate_prompt_tokens``: keep only k prompt tokens (k >= 1), or -1 for as many as the
      model takes (``max_model_len``); ``truncation_side`` "left" (default) keeps the last k,
      "right" the first k. None keeps the whole prompt (a longer one is an error).
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] = "left"
    # Filled in by the engine from the model's pooler config, not by users.
    pooling_type: str = "LAST"

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not _positive(self.dimensions)):
            raise ValueError(f"dimensions must be an integer >= 1 (or None for all), got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or None (the model's default), got {self.normalize!r}")
        keep = self.truncate_prompt_tokens
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or (keep < 1 and keep != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (as many as fit) or an integer >= 1, got {keep!r}")
        if self.truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS read hidden states of the prompt's start, which a prefix-cache hit skips."""
        return self.pooling_type != "LAST"


def _positive(value: object) -> bool:
    return isinstance(value, int) and value >= 1
