"""Executor with one worker process per rank: tensor-parallel ranks (``tensor_parallel_size > 1``),
pipeline stages (``pipeline_parallel_size > 1``), or both (each stage's ranks in a row).

Every rank, rank 0 included, is a child process (multiprocessing ``spawn``): the engine core's
process never initialises ``torch.distributed`` nor changes its own torch thread count, so a
TP=1 engine (or the user's code) in the same process is unaffected, and every rank is handled
alike (start, death, shutdown). The cost is one pickled ``ModelRunnerOutput`` per step.

Each step the engine core sends the ``SchedulerOutput`` down one pipe per rank, then waits for
every rank's answer; the output rank's is the step's result (the others answer ``None``). With
tensor parallelism that is rank 0, and every rank samples the same tokens: the logits are
all-gathered (bit-identical on every rank), and every rank seeds torch alike and draws in the
same order, so workers' per-request state never diverges. With pipeline parallelism it is the
last stage, the only one that samples: each stage runs its layers and sends its hidden states
and residual to the next (``distributed/pipeline.py``), and the last stage broadcasts the
sampled tokens in the engine core's next plan (``CachedRequestData.new_token_ids``), so no stage
waits for a later one. The engine core keeps up to one step per stage in flight
(``submit_model``; ``engine/batch_queue.py``): each rank reads its steps in order and answers in
order, so the engine collects them oldest first. A stage reads its pipe on a thread of its own
then, so a large plan sent while the stage computes never blocks the engine core (which would
block the stage's answer in turn). The waits watch each worker's process sentinel: a rank that dies makes the step raise
at once, naming it, and a rank that goes silent raises after ``PAGEDLLM_EXECUTOR_TIMEOUT_S``.

Crash safety: each worker arms ``PR_SET_PDEATHSIG`` (SIGKILL) first thing and exits if its
parent is already gone; ``shutdown()`` (also run at garbage collection and interpreter exit)
asks every rank to stop, then terminates and kills what is left.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import time
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, cast

from pagedllm import cpu_info, envs
from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor import die_with_parent
from pagedllm.executor.pending import PendingStep, reader_thread
from pagedllm.metrics.startup import StartupPhases

if TYPE_CHECKING:
    from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

_INIT_TIMEOUT_S = 60.0  # torch.distributed rendezvous and gloo collectives (the default is 30 min)
_STARTUP_TIMEOUT_S = 600.0  # loading the weights, compiling the CPU kernels
_STOP_TIMEOUT_S = 5.0


def threads_per_rank(world_size: int) -> int:
    """Split the usable cores between the ranks (at least one each): more threads than cores
    across ranks is a 7-8x slowdown (docs: distributed facts)."""
    return max(1, cpu_info.usable_cpus() // world_size)


class WorkerDiedError(RuntimeError):
    """A worker process (a tensor-parallel rank or a pipeline stage) exited or stopped answering."""


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parallel = config.parallel_config
        self.world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        # The rank whose step output is the engine's: tensor-parallel rank 0 of the last stage.
        self.output_rank = self.world_size - parallel.tensor_parallel_size
        kind = "pp" if parallel.pipeline_parallel_size > 1 else "tp"
        self.startup = StartupPhases()
        ctx = mp.get_context("spawn")
        if mp.current_process().daemon:
            # A server's engine core is a daemon process, which multiprocessing forbids children;
            # the flag only acts at an orderly exit, and our workers are reaped by shutdown() and
            # die with us anyway (PDEATHSIG).
            mp.current_process().daemon = False
        port = free_port()
        threads = threads_per_rank(self.world_size)
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self._closed = False
        self._submitted = self._collected = 0  # steps sent with submit_model, and collected
        start = time.perf_counter()
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(config, rank, self.world_size, port, threads, os.getpid(), child_end),
                name=f"pagedllm-{kind}{rank}",
                daemon=True,
            )
            proc.start()  # from the constructing thread: PDEATHSIG follows that thread's life
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        try:
            answers = self._gather(_STARTUP_TIMEOUT_S, "start-up")
        except BaseException:
            self._abort()
            raise
        self.startup.add("worker processes", time.perf_counter() - start)
        for name, seconds in answers[0].items():  # rank 0's phases stand for all
            self.startup.add(f"rank 0 {name}", seconds)
        logger.info(
            "%s: %d worker processes (pids %s), %d intra-op thread(s) each",
            "pipeline parallel" if kind == "pp" else "tensor parallel",
            self.world_size,
            [p.pid for p in self.procs],
            threads,
        )

    # ------------------------------------------------------------------ the executor interface
    def determine_num_blocks(self) -> int:
        return int(min(self._call("determine_num_blocks")))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("initialize_kv_cache", num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        result = self._call("execute_model", sched, timeout=envs.executor_timeout_s())[self.output_rank]
        assert isinstance(result, ModelRunnerOutput)
        return result

    def collective_stats(self) -> dict[str, int] | None:
        """Rank 0's shared-memory collective counters (``ShmAllReduce.stats``; None without them),
        for benchmarks: not part of the executor interface."""
        return cast(dict[str, int] | None, self._call("collective_stats")[0])

    def submit_model(self, sched: SchedulerOutput) -> PendingStep:
        """Send a step and return at once (pipeline stages); ``result()`` collects it, oldest first."""
        self._send("execute_model", (sched,))
        self._submitted += 1
        return PendingStep(self.collect, self._submitted)

    def collect(self, index: int) -> ModelRunnerOutput:
        """The output of the ``index``-th submitted step, which must be the oldest not collected."""
        assert index == self._collected + 1, "steps are collected in the order they were submitted"
        self._collected = index
        result = self._gather(envs.executor_timeout_s(), "execute_model")[self.output_rank]
        assert isinstance(result, ModelRunnerOutput)
        return result

    def shutdown(self) -> None:
        """Stop every rank (idempotent)."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    # ------------------------------------------------------------------ transport
    def _call(self, method: str, *args: Any, timeout: float = _STARTUP_TIMEOUT_S) -> list[Any]:
        self._send(method, args)
        return self._gather(timeout, method)

    def _send(self, method: str, args: tuple[Any, ...]) -> None:
        if self._closed:
            raise WorkerDiedError("the worker processes are shut down")
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((method, args))
            except (BrokenPipeError, ConnectionResetError, OSError) as e:
                self._abort()
                raise self._died(rank, method) from e

    def _gather(self, timeout: float, what: str) -> list[Any]:
        """Every rank's answer to the last request; raises when a rank dies, fails or times out."""
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self.conns))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._abort()
                ranks = sorted(pending)
                raise WorkerDiedError(f"worker rank(s) {ranks} did not answer {what!r} within {timeout:.0f} s")
            ready = wait([*pending.values(), *sentinels], left)
            for obj in ready:
                if obj in sentinels:  # a process exited: read its last answer first (an error message)
                    rank = sentinels[obj]
                    if rank in pending and pending[rank].poll():
                        continue
                    self._abort()
                    raise self._died(rank, what)
                rank = next(r for r, c in pending.items() if c is obj)
                try:
                    ok, payload = pending[rank].recv()
                except (EOFError, OSError) as e:
                    self._abort()
                    raise self._died(rank, what) from e
                if not ok:
                    dead = self._dead_peer(rank)
                    self._abort()
                    if dead is not None:  # its death broke this rank's transfer: name the cause
                        raise self._died(dead, what)
                    if isinstance(payload, ValueError):  # a setting that does not fit: the user's to fix
                        raise ValueError(f"{payload} (worker rank {rank})")
                    raise WorkerDiedError(f"worker rank {rank} failed in {what!r}: {payload}")
                answers[rank] = payload
                del pending[rank]
        return [answers[r] for r in range(self.world_size)]

    def _abort(self) -> None:
        """A rank failed: the others may be waiting for it inside a collective, deaf to a polite
        stop, so terminate them now, then reap."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        self.shutdown()

    def _dead_peer(self, rank: int) -> int | None:
        """A rank other than ``rank`` that has exited (a peer killed mid-step makes the others'
        collectives or transfers fail a moment later), or None."""
        for peer, proc in enumerate(self.procs):
            if peer != rank:
                proc.join(0.05)  # a killed peer's exit is reaped within this
                if proc.exitcode is not None:
                    return peer
        return None

    def _died(self, rank: int, what: str) -> WorkerDiedError:
        proc = self.procs[rank]
        proc.join(0.1)
        code = proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return WorkerDiedError(f"worker rank {rank} (pid {proc.pid}) died during {what!r} ({how})")


def _stop_workers(procs: list[BaseProcess], conns: list[Connection]) -> None:
    """Ask politely, then terminate, then kill; reap every worker."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send(("shutdown", ()))
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    for conn in conns:
        conn.close()


def portable_error(exc: Exception) -> Exception:
    """A worker's exception as the engine core will get it: ValueError as is, anything else by name."""
    return ValueError(str(exc)) if isinstance(exc, ValueError) else RuntimeError(f"{type(exc).__name__}: {exc}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_rank(
    config: EngineConfig, rank: int, world_size: int, init_method: str, threads: int, same_host: bool
) -> Worker:
    """Everything a rank does before it serves steps (here and in a Ray actor, ``ray_executor.py``):
    its thread count, ``torch.distributed`` (gloo), the TP group, the worker and its weights.
    ``same_host``: every rank of the group is on this machine, so the shared-memory all-reduce
    can join them (it cannot span hosts)."""
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


def _worker_main(
    config: EngineConfig, rank: int, world_size: int, port: int, threads: int, parent_pid: int, conn: Connection
) -> None:
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when we stop
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank{rank}] %(message)s")
    import torch.distributed as dist

    try:
        worker = init_rank(config, rank, world_size, f"tcp://127.0.0.1:{port}", threads, same_host=True)
        conn.send((True, dict(worker.startup.seconds)))
    except Exception as e:
        conn.send((False, portable_error(e)))
        raise SystemExit(1) from e
    # A pipeline stage may be sent its next steps while it computes: read them on a thread.
    receive = reader_thread(conn) if config.parallel_config.pipeline_parallel_size > 1 else conn.recv
    try:
        while True:
            try:
                method, args = receive()
            except EOFError:  # the engine core is gone
                break
            if method == "shutdown":
                break
            output_rank = world_size - config.parallel_config.tensor_parallel_size
            ok, payload = run_method(worker, rank, method, args, output_rank)
            conn.send((ok, payload))
            if not ok:
                break
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
