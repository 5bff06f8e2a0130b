"""Parallelism: ``ParallelArgs`` -> frozen ``ParallelConfig`` (tensor or pipeline parallel on CPU,
local processes, processes on several nodes, or Ray actors; data-parallel engine cores behind one
server)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from urllib.parse import urlsplit

from pagedllm.config.options import check_choice, check_positive, option

DISTRIBUTED_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    # Several nodes without Ray: node 0 (the engine) listens at the init method's address; the
    # other nodes run only their worker ranks (``--headless``).
    distributed_init_method: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    headless: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


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
        "tcp://HOST:PORT of node 0 for a multi-node run without Ray (--nnodes > 1): node 0 runs the engine "
        "and listens there (HOST: one of its own, routable addresses); every node is given the same value",
        default_help="none: one machine, or Ray's own rendezvous",
    )
    nnodes: int = option(
        1,
        "nodes of a --distributed-init-method run; the tp x pp ranks are split evenly, node R holding "
        "global ranks R*k .. R*k+k-1 (k = tp x pp / nnodes)",
    )
    node_rank: int = option(
        0, "this node's index (0..nnodes-1) in a --distributed-init-method run; 0 runs the engine and the server"
    )
    headless: bool = option(
        False,
        "`pagedllm serve` on a node other than node 0 of a --nnodes run: start only this node's worker "
        "ranks (no API server, no engine; the engine settings come from node 0, and MODEL must be at the "
        "same path here) and exit when node 0 stops or dies",
    )

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
        self._check_nodes()
        return ParallelConfig(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.data_parallel_size,
            self.distributed_executor_backend,
            self.distributed_init_method,
            self.nnodes,
            self.node_rank,
            self.headless,
        )

    def _check_nodes(self) -> None:
        """The multi-node flags fit together (checked on every node before anything starts)."""
        check_positive("nnodes", self.nnodes)
        multi = self.nnodes > 1 or self.distributed_init_method is not None or self.node_rank != 0 or self.headless
        if not multi:
            return
        if self.distributed_executor_backend == "ray":
            raise ValueError(
                "--nnodes/--node-rank/--distributed-init-method/--headless start the ranks on each node "
                "without Ray; the Ray backend places them on its cluster's nodes itself: drop those flags, "
                "or drop --distributed-executor-backend ray"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank={self.node_rank} is out of range for nnodes={self.nnodes}: use 0..{self.nnodes - 1}"
            )
        if self.nnodes == 1:
            raise ValueError(
                "--distributed-init-method and --headless are for runs over several nodes: give --nnodes N > 1 "
                "(and each node its --node-rank), or drop them on one machine"
            )
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if world % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {world} ranks cannot be split evenly over "
                f"nnodes={self.nnodes}: make the ranks a multiple of the node count"
            )
        if self.distributed_init_method is None:
            raise ValueError(
                f"nnodes={self.nnodes} needs --distributed-init-method tcp://<node 0's IP>:<port>, the same on every node"
            )
        parse_init_method(self.distributed_init_method)
        if self.node_rank == 0 and self.headless:
            raise ValueError("node 0 runs the engine and the server: drop --headless there (it is for node_rank >= 1)")
        if self.node_rank > 0 and not self.headless:
            raise ValueError(
                f"node_rank={self.node_rank} runs only worker ranks: start it with `pagedllm serve MODEL ... "
                "--headless` (node 0 runs the engine)"
            )

    def _check_ray(self) -> None:
        check_ray_installed()
        if self.pipeline_parallel_size > 1 or self.data_parallel_size > 1:
            raise ValueError(
                "distributed_executor_backend='ray' runs tensor parallelism only for now: use "
                "pipeline_parallel_size=1 and data_parallel_size=1 with it, or the default backend (mp)"
            )


def parse_init_method(value: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); a ValueError that shows the expected form otherwise."""
    form = f"distributed_init_method={value!r} must be tcp://HOST:PORT (node 0's address and a free port)"
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(form) from None
    if parts.scheme != "tcp" or not parts.hostname or port is None or port == 0 or parts.path not in ("", "/"):
        raise ValueError(form)
    return parts.hostname, port


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
