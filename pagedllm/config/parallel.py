"""Parallelism: ``ParallelArgs`` -> frozen ``ParallelConfig`` (tensor or pipeline parallel on CPU,
local processes or Ray actors; data-parallel engine cores behind one server)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from pagedllm.config.options import check_choice, check_positive, option

DISTRIBUTED_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "mp"


@dataclass
class ParallelArgs:
    """How many ranks share the model."""

    tensor_parallel_size: int = option(
        1,
        "tensor-parallel ranks: one worker process each (CPU, gloo); must divide the attention heads",
        aliases=("-tp",),
    )
    pipeline_parallel_size: int = option(
        1,
        "pipeline-parallel stages: one worker process each (CPU, gloo), each holding a share of the layers "
        "(PAGEDLLM_PP_LAYER_PARTITION=a,b,... sets the split); with tensor parallelism, tp x pp processes",
        aliases=("-pp",),
    )
    data_parallel_size: int = option(
        1,
        "data-parallel engine cores behind one API server (`serve` only): each a full engine with its own "
        "scheduler, KV cache (kv_cache_memory each) and 1/N of the cores; requests go to the least-loaded one, "
        "or to the one that recently served the prompt's first block",
        aliases=("-dp",),
    )

    distributed_executor_backend: str = option(
        "mp",
        "where the ranks run: mp (one local process per rank) or ray (one Ray actor per rank, on one "
        "or several nodes of a Ray cluster; needs pip install 'pagedllm[ray]')",
        choices=DISTRIBUTED_BACKENDS,
    )
    distributed_init_method: str | None = option(
        None,
        "tcp://host:port rendezvous for multi-node torch.distributed without Ray (not available yet)",
        default_help="none: one machine, or Ray's own rendezvous",
    )
    nnodes: int = option(1, "nodes of a --distributed-init-method run (not available yet)")
    node_rank: int = option(0, "this node's index in a --distributed-init-method run (not available yet)")

    def create_parallel_config(self) -> ParallelConfig:
        check_positive("tensor_parallel_size", self.tensor_parallel_size)
        check_positive("pipeline_parallel_size", self.pipeline_parallel_size)
        check_positive("data_parallel_size", self.data_parallel_size)
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.data_parallel_size > 1 and model_parallel > 1:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size} with tensor_parallel_size="
                f"{self.tensor_parallel_size} and pipeline_parallel_size={self.pipeline_parallel_size} is not "
                "supported: use data parallelism (data_parallel_size > 1, tensor and pipeline parallel sizes 1) "
                "or tensor/pipeline parallelism (data_parallel_size=1), not both"
            )
        check_choice("distributed_executor_backend", self.distributed_executor_backend, DISTRIBUTED_BACKENDS)
        if self.distributed_executor_backend == "ray":
            self._check_ray()
        if self.distributed_init_method is not None or self.nnodes != 1 or self.node_rank != 0:
            raise ValueError(
                "--distributed-init-method/--nnodes/--node-rank (multi-node torch.distributed without Ray) "
                "are not available yet: for several nodes use --distributed-executor-backend ray on a Ray cluster"
            )
        return ParallelConfig(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.data_parallel_size,
            self.distributed_executor_backend,
        )

    def _check_ray(self) -> None:
        check_ray_installed()
        if self.pipeline_parallel_size > 1 or self.data_parallel_size > 1:
            raise ValueError(
                "distributed_executor_backend='ray' runs tensor parallelism only for now: use "
                "pipeline_parallel_size=1 and data_parallel_size=1 with it, or the default backend (mp)"
            )


def check_data_parallel(dp: int, device: str) -> None:
    """Start-up check: data-parallel engine cores each size their own KV pool, which on CUDA is a
    fraction of the one device's free memory, so several would overcommit it."""
    if dp > 1 and device != "cpu":
        raise ValueError(
            f"data_parallel_size={dp} runs on CPU only for now (device={device!r}): use data_parallel_size=1"
        )


def check_ray_installed() -> None:
    """The Ray backend's one dependency, checked before anything starts."""
    if importlib.util.find_spec("ray") is None:
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray, which is not installed: "
            "pip install 'pagedllm[ray]' (or use the default backend, mp, on one machine)"
        )


def check_tensor_parallel(tp: int, num_heads: int, num_kv_heads: int, device: str) -> None:
    """Start-up check that ``tp`` ranks can split the model: the query heads divide evenly, and
    the KV heads too, or (fewer KV heads than ranks) each KV head is replicated on ``tp //
    num_kv_heads`` ranks, which needs ``tp`` to be a multiple of them."""
    if tp == 1:
        return
    if device != "cpu":
        raise ValueError(f"tensor_parallel_size={tp} runs on CPU only for now (device={device!r})")
    valid = [n for n in range(1, num_heads + 1) if _splits(n, num_heads, num_kv_heads)]
    if not _splits(tp, num_heads, num_kv_heads):
        raise ValueError(
            f"tensor_parallel_size={tp} cannot split the model's {num_heads} attention heads "
            f"({num_kv_heads} KV heads); valid sizes: {valid}"
        )


def check_pipeline_parallel(pp: int, num_layers: int, device: str) -> None:
    """Start-up check that ``pp`` stages can split the model's layers (and the split asked for)."""
    if pp == 1:
        return
    if device != "cpu":
        raise ValueError(f"pipeline_parallel_size={pp} runs on CPU only for now (device={device!r})")
    from pagedllm.distributed.partition import layer_partition

    layer_partition(num_layers, pp)


def _splits(tp: int, num_heads: int, num_kv_heads: int) -> bool:
    if num_heads % tp:
        return False
    return num_kv_heads % tp == 0 if num_kv_heads >= tp else tp % num_kv_heads == 0


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads each rank caches: its share, or one replicated head when ranks outnumber them."""
    return max(1, num_kv_heads // tp)
