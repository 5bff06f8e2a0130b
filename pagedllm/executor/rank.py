"""What a rank process runs (a local one, another node's, or a Ray actor's): its start-up
(threads, torch.distributed over gloo, its tensor- and pipeline-parallel groups, the worker and
its weights) and the loop that answers the engine core's requests."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from pagedllm import cpu_info, envs
from pagedllm.config import EngineConfig
from pagedllm.executor import die_with_parent
from pagedllm.executor.net import pin_gloo_interface
from pagedllm.executor.pending import reader_thread

if TYPE_CHECKING:
    from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

_INIT_TIMEOUT_S = 60.0  # torch.distributed rendezvous and gloo collectives (the default is 30 min)


def threads_per_rank(world_size: int) -> int:
    """Split the usable cores between the ranks (at least one each): more threads than cores
    across ranks is a 7-8x slowdown (docs: distributed facts)."""
    return max(1, cpu_info.usable_cpus() // world_size)


def portable_error(exc: Exception) -> Exception:
    """A worker's exception as the engine core will get it: ValueError as is, anything else by name."""
    return ValueError(str(exc)) if isinstance(exc, ValueError) else RuntimeError(f"{type(exc).__name__}: {exc}")


def init_rank(
    config: EngineConfig,
    rank: int,
    world_size: int,
    init_method: str,
    threads: int,
    same_host: bool,
    node_ip: str | None = None,
) -> Worker:
    """Everything a rank does before it serves steps (here and in a Ray actor, ``ray_executor.py``):
    its thread count, ``torch.distributed`` (gloo), the TP group, the worker and its weights.
    ``same_host``: every rank of the group is on this machine, so the shared-memory all-reduce
    can join them (it cannot span hosts). ``node_ip``: ranks on several hosts bind gloo to the
    interface holding it, not to what the hostname resolves to."""
    if node_ip is not None:
        pin_gloo_interface(node_ip)
    if not envs.omp_num_threads():  # a user's OMP_NUM_THREADS wins
        envs.set_omp_num_threads(threads)  # before torch starts; the worker's thread set-up honours it
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(envs.omp_num_threads()))
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        # Every later collective and transfer inherits this: a pipeline stage waits for the others'
        # whole step (a long prefill chunk), so it is the step timeout, not the rendezvous one.
        timeout=datetime.timedelta(seconds=max(_INIT_TIMEOUT_S, envs.executor_timeout_s())),
    )
    from pagedllm.worker.worker import Worker  # noqa: F811 (the real import, after torch's set-up)

    _install_groups(config, rank, world_size, same_host)
    worker = Worker(config)
    worker.load_model()
    return worker


def run_method(worker: Any, rank: int, method: str, args: tuple[Any, ...], output_rank: int = 0) -> tuple[bool, Any]:
    """One request to a rank: ``(True, result)`` (``output_rank``'s result: rank 0, or with
    pipeline stages the last stage's first rank; the others answer None but for the block count)
    or ``(False, exception)`` after a failure."""
    try:
        result = getattr(worker, method)(*args)
    except Exception as e:
        logger.exception("rank %d failed in %s", rank, method)
        return False, portable_error(e)
    return True, result if rank == output_rank or method == "determine_num_blocks" else None


def worker_main(
    config: EngineConfig,
    rank: int,
    init_method: str,
    threads: int,
    node_ip: str | None,
    parent_pid: int,
    conn: Connection,
) -> None:
    """A rank on the engine core's node (a spawned child; its ``conn`` a pipe)."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when we stop
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank{rank}] %(message)s")
    parallel = config.parallel_config
    same_host = parallel.nnodes == 1
    run_rank(
        conn,
        config,
        rank,
        partial(init_rank, config, rank, parallel.world_size, init_method, threads, same_host, node_ip),
    )


def run_rank(conn: Connection, config: EngineConfig, rank: int, start: Callable[[], Worker]) -> bool:
    """Start the rank (``start``: its ``init_rank``), report ready on ``conn`` (a pipe, or another
    node's socket), then answer its requests until told to stop (True) or until the engine core
    is gone or a request failed (False)."""
    import torch.distributed as dist

    try:
        worker = start()
        conn.send((True, dict(worker.startup.seconds)))
    except Exception as e:
        with contextlib.suppress(OSError):
            conn.send((False, portable_error(e)))
        raise SystemExit(1) from e
    output_rank = config.parallel_config.world_size - config.parallel_config.tensor_parallel_size
    # A pipeline stage may be sent its next steps while it computes: read them on a thread.
    receive = reader_thread(conn) if config.parallel_config.pipeline_parallel_size > 1 else conn.recv
    try:
        while True:
            try:
                method, args = receive()
            except (EOFError, OSError):  # the engine core is gone
                return False
            if method == "shutdown":
                return True
            ok, payload = run_method(worker, rank, method, args, output_rank)
            conn.send((ok, payload))
            if not ok:
                return False
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _install_groups(config: EngineConfig, rank: int, world_size: int, same_host: bool) -> None:
    """The layers' view of this rank: its tensor-parallel group (the ranks of its stage) and, with
    pipeline stages, its pipeline group (its counterparts in every stage). Ranks are laid out
    stage by stage: rank = stage * tp + tp_rank (vLLM's order). ``same_host``: every rank is on
    this machine, so the shared-memory all-reduce can join them (it cannot span hosts)."""
    from pagedllm.distributed import shm_allreduce
    from pagedllm.distributed.parallel_state import TPGroup, set_tp_group
    from pagedllm.distributed.pipeline import PPGroup, set_pp_group

    tp, pp = config.parallel_config.tensor_parallel_size, config.parallel_config.pipeline_parallel_size
    if pp > 1:
        import torch.distributed as dist

        # Every rank creates every group, in the same order (torch.distributed's rule).
        tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        pp_groups = [dist.new_group(list(range(t, world_size, tp))) for t in range(tp)]
        stage, tp_rank = divmod(rank, tp)
        set_tp_group(TPGroup(tp_rank, tp, tp_groups[stage]) if tp > 1 else TPGroup())
        set_pp_group(PPGroup(stage, pp, pp_groups[tp_rank]))
        return
    shm = None
    # Ranks spin while they wait for each other: only when each has a core of its own.
    own_core = world_size <= cpu_info.usable_cpus()
    if same_host and envs.enabled("PAGEDLLM_SHM_ALLREDUCE") and shm_allreduce.supported() and own_core:
        shm = shm_allreduce.ShmAllReduce(rank, world_size, timeout_s=max(_INIT_TIMEOUT_S, envs.executor_timeout_s()))
    set_tp_group(TPGroup(rank, world_size, None, shm))
