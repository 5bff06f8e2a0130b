"""The pipeline-parallel group: which stage this rank is, which layers it owns, and the stage-to-stage
transfers.

Model files ask :func:`get_pp_group` once, at construction, for their layer range (and whether they
hold the embedding, the final norm and the LM head); the model runner uses it to receive the previous
stage's hidden states and residual and to send its own to the next stage. The tokens the last stage
samples reach the other stages in the engine core's next plan (``CachedRequestData.new_token_ids``),
so no stage ever waits for a later one, and several batches can be in flight. Without an installed
group (one process, tests) this is stage 0 of 1, owning every layer, and nothing is sent.

The layer split is even by default; what does not divide goes to the stages before the last, since
the last one also runs the LM head and the sampler (vLLM's ``get_pp_indices``).
``PAGEDLLM_PP_LAYER_PARTITION="a,b,..."`` sets the split explicitly (``distributed/partition.py``).

Transfers are torch.distributed point-to-point over gloo: a stage knows the step's token count and
the hidden size from the scheduler output it got like every stage, so only the data moves (one
``[2, T, hidden]`` tensor per step), no metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.distributed.partition import layer_partition


@dataclass(frozen=True)
class PPGroup:
    """This rank's stage ``rank`` of ``size``, in ``group``: one rank per stage, the same
    tensor-parallel rank in each (its ranks in stage order), so a stage's every TP rank talks to
    its counterparts only (the hidden states are whole on every TP rank)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: torch.distributed's default (world) group

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of the decoder layers this stage builds and runs."""
        if self.size == 1:
            return 0, num_layers
        sizes = layer_partition(num_layers, self.size)
        start = sum(sizes[: self.rank])
        return start, start + sizes[self.rank]

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Hand this stage's output (hidden states and residual stream) to the next stage."""
        dist.send(torch.stack((hidden, residual)), group=self.group, group_dst=self.rank + 1)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden states, residual) for a step of ``num_tokens`` tokens."""
        buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype)
        dist.recv(buf, group=self.group, group_src=self.rank - 1)
        return buf[0], buf[1]


_SINGLE = PPGroup()
_PP_GROUP: PPGroup | None = None


def set_pp_group(group: PPGroup | None) -> None:
    """Install ``group`` for the models built from now on (None: a single stage)."""
    global _PP_GROUP
    _PP_GROUP = group


def get_pp_group() -> PPGroup:
    return _PP_GROUP if _PP_GROUP is not None else _SINGLE
