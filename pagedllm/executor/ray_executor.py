"""Executor with one Ray actor per tensor-parallel rank (``--distributed-executor-backend ray``).

The engine core uses it exactly like ``MultiprocExecutor``; the ranks may sit on several nodes
of a Ray cluster. Start-up: connect to the running cluster (``RAY_ADDRESS``, else the one this
machine belongs to) or, with none running, start a local one; reserve one CPU bundle per rank in
a placement group (PACK, or STRICT_SPREAD with ``PAGEDLLM_RAY_PLACEMENT=spread``), rank 0's
pinned to the engine core's node when that node is in the cluster; start one ``RankActor`` per
bundle. Rank 0's actor names the rendezvous: its node's IP as Ray reports it (never a loopback
address another host could not reach) and a free port there. Each actor then runs the very
start-up of a multiprocess worker (``rank.init_rank``): gloo between the ranks, the
shared-memory all-reduce only when every rank is on one host.

Each step the ``SchedulerOutput`` is put in the object store once and every actor runs it; rank
0's answer is the step's result. Waits are bounded (``PAGEDLLM_EXECUTOR_TIMEOUT_S``): a dead actor
makes the step raise ``WorkerDiedError`` naming its rank as soon as Ray reports the death.
``shutdown()`` (also at garbage collection and interpreter exit) kills the actors, removes the
placement group and disconnects from a Ray instance this executor started.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.config.parallel import check_ray_installed
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor import WorkerDiedError
from pagedllm.executor.net import free_port, pin_gloo_interface
from pagedllm.executor.rank import init_rank, portable_error, run_method
from pagedllm.metrics.startup import StartupPhases

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 60.0  # the cluster has the CPUs or it does not; waiting longer rarely helps
_STARTUP_TIMEOUT_S = 600.0  # loading the weights, compiling the CPU kernels
_DEATH_GRACE_S = 3.0  # after one rank fails, how long to look for a dead peer that caused it


@dataclass(frozen=True)
class RankPlace:
    """Where a rank's actor runs."""

    node_ip: str
    pid: int


class RankActor:
    """One rank: wrapped by ``ray.remote`` at start-up (Ray stays optional), runs on its node."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.rank = -1

    def where(self) -> RankPlace:
        import ray

        return RankPlace(ray.util.get_node_ip_address(), os.getpid())

    def free_port(self, host: str) -> int:
        return free_port(host)

    def init(
        self, config: EngineConfig, rank: int, world_size: int, init_method: str, threads: int, same_host: bool
    ) -> tuple[bool, Any]:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [tp{rank}] %(message)s")
        self.rank = rank
        pin_gloo_interface(self.where().node_ip)
        try:
            self.worker = init_rank(config, rank, world_size, init_method, threads, same_host)
        except Exception as e:
            return False, portable_error(e)
        return True, dict(self.worker.startup.seconds)

    def call(self, method: str, *args: Any) -> tuple[bool, Any]:
        return run_method(self.worker, self.rank, method, args)


def _import_ray() -> Any:
    check_ray_installed()
    import ray

    return ray


def connect(ray: Any, num_cpus: int) -> bool:
    """Join the running cluster, else start a local one; True when this call connected (so
    shutdown disconnects), False when the process was connected already."""
    if ray.is_initialized():
        logger.info("Ray: using this process's connection to %s", ray.get_runtime_context().gcs_address)
        return False
    try:
        ray.init(address="auto", logging_level=logging.WARNING)  # RAY_ADDRESS, else this machine's cluster
        logger.info("Ray: connected to the running cluster at %s", ray.get_runtime_context().gcs_address)
    except ConnectionError:
        cpus = max(num_cpus, os.cpu_count() or 1)
        ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
        logger.info("Ray: no cluster running, started a local one with %d CPUs (ray start --head for a cluster)", cpus)
    return True


def place(ray: Any, world_size: int, cpus: int, strategy: str) -> Any:
    """A ready placement group of one ``{"CPU": cpus}`` bundle per rank; bundle 0 on this node."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles: list[dict[str, float]] = [{"CPU": float(cpus)} for _ in range(world_size)]
    here = f"node:{ray.util.get_node_ip_address()}"
    if here in ray.cluster_resources():  # rank 0 beside the engine core when this node is in the cluster
        bundles[0][here] = 0.001
    pg = placement_group(bundles, strategy=strategy)
    if not pg.wait(timeout_seconds=_PLACEMENT_TIMEOUT_S):
        remove_placement_group(pg)
        raise ValueError(
            f"the Ray cluster cannot place {world_size} rank(s) of {cpus} CPU each with strategy {strategy} "
            f"within {_PLACEMENT_TIMEOUT_S:.0f} s (available: {ray.available_resources()}); add nodes or CPUs "
            "(ray start --address ... --num-cpus N), lower --tensor-parallel-size, or set PAGEDLLM_RAY_PLACEMENT"
        )
    return pg


class RayExecutor:
    def __init__(self, config: EngineConfig) -> None:
        if config.device != "cpu":  # bundles reserve CPUs only: Ray hides the GPUs from such actors
            raise ValueError(f"distributed_executor_backend='ray' runs on CPU only for now (device={config.device!r})")
        ray = self._ray = _import_ray()
        self.world_size = config.parallel_config.tensor_parallel_size
        self.startup = StartupPhases()
        self._closed = False
        cpus, strategy = envs.ray_cpus_per_rank(), envs.ray_placement()
        start = time.perf_counter()
        started = connect(ray, self.world_size * cpus)
        self.actors: list[Any] = []
        self.pgs: list[Any] = []  # the placement group, once placed (a list: the finalizer shares it)
        self._finalizer = weakref.finalize(self, _stop, ray, self.actors, self.pgs, started)
        try:
            self.pgs.append(place(ray, self.world_size, cpus, strategy))
            self._start_actors(cpus)
            phases = self._start_ranks(config, cpus)
        except BaseException:
            self.shutdown()
            raise
        self.startup.add("Ray actors", time.perf_counter() - start)
        for name, seconds in phases.items():  # rank 0's phases stand for all
            self.startup.add(f"rank 0 {name}", seconds)
        logger.info("tensor parallel over Ray (%s): ranks on %s", strategy, [(p.node_ip, p.pid) for p in self.places])

    def _start_actors(self, cpus: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = self._ray.remote(num_cpus=cpus, max_restarts=0)(RankActor)
        for rank in range(self.world_size):
            where = PlacementGroupSchedulingStrategy(self.pgs[0], placement_group_bundle_index=rank)
            self.actors.append(cls.options(scheduling_strategy=where, name=None).remote())
        self.places: list[RankPlace] = self._gather(
            [a.where.remote() for a in self.actors], _STARTUP_TIMEOUT_S, "start"
        )

    def _start_ranks(self, config: EngineConfig, cpus: int) -> dict[str, float]:
        """Rendezvous at rank 0's node IP; the shared-memory all-reduce only on one host."""
        host = self.places[0].node_ip
        port = self._gather([self.actors[0].free_port.remote(host)], _STARTUP_TIMEOUT_S, "start")[0]
        same_host = len({p.node_ip for p in self.places}) == 1
        refs = [
            a.init.remote(config, rank, self.world_size, f"tcp://{host}:{port}", cpus, same_host)
            for rank, a in enumerate(self.actors)
        ]
        return self._answers(self._gather(refs, _STARTUP_TIMEOUT_S, "start-up"), "start-up")[0]

    # ------------------------------------------------------------------ the executor interface
    def determine_num_blocks(self) -> int:
        return int(min(self._call("determine_num_blocks")))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("initialize_kv_cache", num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        result = self._call("execute_model", self._ray.put(sched), timeout=envs.executor_timeout_s())[0]
        assert isinstance(result, ModelRunnerOutput)
        return result

    def check_health(self) -> None:
        """Nothing between steps: Ray reports a dead actor at the next step's wait."""

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group (idempotent)."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    # ------------------------------------------------------------------ transport
    def _call(self, method: str, *args: Any, timeout: float = _STARTUP_TIMEOUT_S) -> list[Any]:
        if self._closed:
            raise WorkerDiedError("the tensor-parallel Ray actors are shut down")
        refs = [a.call.remote(method, *args) for a in self.actors]  # an ObjectRef argument arrives resolved
        return self._answers(self._gather(refs, timeout, method), method)

    def _answers(self, replies: list[tuple[bool, Any]], what: str) -> list[Any]:
        for rank, (ok, payload) in enumerate(replies):
            if not ok:
                raise self._failed(rank, payload, what)
        return [payload for _, payload in replies]

    def _failed(self, rank: int, payload: Exception, what: str) -> Exception:
        self.shutdown()
        if isinstance(payload, ValueError):  # a setting that does not fit: the user's to fix
            return ValueError(f"{payload} (tensor-parallel rank {rank})")
        return WorkerDiedError(f"tensor-parallel worker rank {rank} failed in {what!r}: {payload}")

    def _gather(self, refs: list[Any], timeout: float, what: str) -> list[Any]:
        """Every ref's value in rank order; a dead actor or a silent one raises, naming the rank.
        A failed rank raises at once (its peers may wait inside a collective for it), but first
        looks briefly for a dead peer: a death breaks the others' collectives, so name the dead."""
        ray = self._ray
        pending = {ref: rank for rank, ref in enumerate(refs)}
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, left))
            if not ready:
                self.shutdown()
                raise WorkerDiedError(
                    f"tensor-parallel Ray actor rank(s) {sorted(pending.values())} did not answer {what!r} "
                    f"within {timeout:.0f} s"
                )
            rank = pending.pop(ready[0])
            try:
                answers[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                self.shutdown()
                raise self._died(rank, what, e) from e
            if isinstance(answers[rank], tuple) and answers[rank][0] is False:
                self._raise_if_a_peer_died(pending, what)
                raise self._failed(rank, answers[rank][1], what)
        return [answers[r] for r in range(len(refs))]

    def _raise_if_a_peer_died(self, pending: dict[Any, int], what: str) -> None:
        ray = self._ray
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_DEATH_GRACE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self.shutdown()
                raise self._died(pending[ref], what, e) from e

    def _died(self, rank: int, what: str, e: Exception) -> WorkerDiedError:
        place = self.places[rank] if len(getattr(self, "places", [])) > rank else None
        where = f" (node {place.node_ip}, pid {place.pid})" if place else ""
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return WorkerDiedError(f"tensor-parallel Ray actor rank {rank}{where} died during {what!r}: {reason}")


def _stop(ray: Any, actors: list[Any], pgs: list[Any], started: bool) -> None:
    """Kill every actor, remove the placement group, disconnect from a Ray instance we started."""
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    for pg in pgs:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
    if started and ray.is_initialized():
        ray.shutdown()
