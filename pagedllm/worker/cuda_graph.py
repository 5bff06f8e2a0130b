"""CUDA graphs for decode-only steps.

A decode step is tiny per layer (one token per request), so on a GPU the CPU time spent launching
hundreds of kernels dominates. At start-up the model forward is captured once per padded batch
size (1, 2, 4, 8, then every multiple of 8 up to min(max_num_seqs, 256)), reading from static input
buffers; a decode-only step copies its inputs into those buffers, pads the batch up to the next
captured size and replays the graph.

Padding rows are harmless by construction: slot -1 (the Triton ``reshape_and_cache`` kernel skips
negative slots, so no KV is written) and seq_len 0 (the attention kernel's key loop is empty, so
no block table entry or cache block is read; the row's output is zeros and is sliced off).
Everything the captured region reads on the host side is fixed per size: ``max_query_len`` is 1,
the token count is the padded size, and the block table has a fixed width (blocks per max-length
request). Only the Triton backend is captured: the torch backend synchronises with the host.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.config import EngineConfig
from pagedllm.layers.attention.backends.base import AttentionBackend
from pagedllm.layers.attention.metadata import CommonAttentionMetadata
from pagedllm.worker.batch_inputs import BatchInputs
from pagedllm.worker.causal_lm import CausalLM

MAX_CAPTURE_SIZE = 256  # larger decode batches are compute-bound enough to run eagerly


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, 16, 24, ... up to min(max_num_seqs, 256), plus
    that limit itself so every decode batch the scheduler can form is covered."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4, *range(8, limit + 1, 8)) if s <= limit]
    return sizes if sizes[-1] == limit else sizes + [limit]


def padded_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_reqs`` requests (None: too many)."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def graphs_enabled(config: EngineConfig, device: torch.device, backend: AttentionBackend) -> bool:
    """CUDA graphs run on CUDA with the Triton backend, unless ``enforce_eager`` or LoRA (the
    adapters' per-step masks are not captured: a LoRA engine runs decode eagerly)."""
    return (
        device.type == "cuda" and backend.name == "triton" and not config.enforce_eager and config.lora_config is None
    )


class Graph(Protocol):
    """What the runner needs from a graph: capture a callable once, then replay it."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class TorchCudaGraph:
    """A ``torch.cuda.CUDAGraph`` whose memory comes from a pool shared by every captured size."""

    def __init__(self, pool: torch.cuda._POOL_HANDLE) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        fn()  # warm-up: Triton compiles (and specialises on the batch size) outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """Stands in for a CUDA graph on CPU (tests): replay re-runs the callable into the same output."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


@dataclass
class StaticInputs:
    """The buffers every captured graph reads; sized for the largest captured batch."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N]
    seq_lens: torch.Tensor  # [N]
    query_start_loc: torch.Tensor  # [N + 1]: always 0..N (one token per request)
    block_table: torch.Tensor  # [N, width]

    @classmethod
    def allocate(cls, max_size: int, width: int, device: torch.device) -> StaticInputs:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        # Zeros are valid everywhere (token 0, position 0, the null block), so rows never written
        # hold harmless values; padding rows get slot -1 and seq_len 0 at every step.
        return cls(
            zeros(max_size),
            zeros(max_size),
            zeros(max_size).fill_(-1),
            zeros(max_size),
            torch.arange(max_size + 1, dtype=torch.int64, device=device),
            zeros(max_size, width),
        )

    def load(self, batch: BatchInputs, size: int) -> None:
        """Copy a decode-only batch's inputs into rows [0, n) and mark rows [n, size) as padding.

        Stale values past a real row's blocks or in padding rows' ids/positions are never used
        (see the module docstring), so only the two fields that make padding inert are reset.
        """
        attn, n = batch.attn, batch.input_ids.shape[0]
        width = attn.block_table.shape[1]
        assert attn.max_query_len == 1 and attn.num_reqs == n <= size, "not a decode-only batch that fits"
        assert width <= self.block_table.shape[1], "block table wider than a max-length request"
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(attn.slot_mapping)
        self.seq_lens[:n].copy_(attn.seq_lens)
        self.block_table[:n, :width].copy_(attn.block_table)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(0)

    def metadata(self, size: int, block_size: int, max_seq_len: int) -> CommonAttentionMetadata:
        """Views over the first ``size`` rows; the host-side fields are fixed for the size."""
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens=self.seq_lens[:size],
            seq_lens_cpu=[max_seq_len] * size,
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            block_size=block_size,
            max_query_len=1,
            max_seq_len=max_seq_len,
        )


class CudaGraphRunner:
    """Captures the model forward per padded decode batch size and replays it for eligible steps."""

    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        sizes: list[int],
        width: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        make_graph: Callable[[], Graph] | None = None,
    ) -> None:
        self.model, self.backend = model, backend
        self.sizes = sizes
        self.block_size, self.max_model_len = block_size, max_model_len
        self.inputs = StaticInputs.allocate(sizes[-1], width, device)
        self.make_graph = make_graph or _cuda_graph_factory()
        self.graphs: dict[int, Graph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0  # for tests and stats

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first (smaller graphs reuse its pool memory); returns seconds."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            graph = self.make_graph()
            self.outputs[size] = graph.capture(self._forward_fn(size))
            self.graphs[size] = graph
        return time.perf_counter() - start

    def _forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        # build_metadata runs inside the capture: its casts (int64 -> int32) replay with the graph.
        common = self.inputs.metadata(size, self.block_size, self.max_model_len)
        ids, positions = self.inputs.input_ids[:size], self.inputs.positions[:size]
        return lambda: self.model(ids, positions, self.backend.build_metadata(common))

    def can_run(self, batch: BatchInputs) -> bool:
        """Decode-only (one token per request, no proposals) and no larger than the largest graph."""
        return batch.attn.max_query_len == 1 and not batch.has_drafts and batch.attn.num_reqs <= self.sizes[-1]

    def run(self, batch: BatchInputs) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` for an eligible batch; a view valid until the next replay."""
        n = batch.attn.num_reqs
        size = padded_size(n, self.sizes)
        assert size is not None, "can_run() first: the batch fits the largest graph"
        self.inputs.load(batch, size)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:n]


def _cuda_graph_factory() -> Callable[[], Graph]:
    pool = torch.cuda.graph_pool_handle()
    return lambda: TorchCudaGraph(pool)
