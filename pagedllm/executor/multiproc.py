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
and residual to the next (``distributed/pipeline.py``), and the sampled tokens reach the other
stages in the engine core's next plan (``CachedRequestData.new_token_ids``), so no stage waits
for a later one. The engine core keeps up to one step per stage in flight (``submit_model``;
``engine/batch_queue.py``): each rank reads its steps in order and answers in order, so the
engine collects them oldest first. A stage reads its pipe on a thread of its own then, so a
large plan sent while the stage computes never blocks the engine core (which would block the
stage's answer in turn). The waits watch each worker's process sentinel: a rank that dies makes the step raise
at once, naming it, and a rank that goes silent raises after ``PAGEDLLM_EXECUTOR_TIMEOUT_S``.

Several nodes (``--nnodes N``, ``executor/multinode.py``): this node runs ranks 0 .. k-1 (k =
world / N) as above; the other nodes' ranks join over TCP at ``--distributed-init-method`` before
these start, and their sockets take the place of the pipes (the same messages). A remote rank
that dies closes its socket, which fails the step waiting for it, or, between steps,
``check_health()`` (the engine core's idle loop calls it).

Crash safety: each worker arms ``PR_SET_PDEATHSIG`` (SIGKILL) first thing and exits if its
parent is already gone; ``shutdown()`` (also run at garbage collection and interpreter exit)
asks every rank to stop, then terminates and kills what is left. The worker side (start-up,
request loop) is ``executor/rank.py``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import time
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, cast

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor import WorkerDiedError
from pagedllm.executor.multinode import RemoteRank, accept_nodes
from pagedllm.executor.net import free_port
from pagedllm.executor.pending import PendingStep
from pagedllm.executor.rank import threads_per_rank, worker_main
from pagedllm.metrics.startup import StartupPhases

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 600.0  # loading the weights, compiling the CPU kernels
_STOP_TIMEOUT_S = 5.0


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parallel = config.parallel_config
        self.world_size = parallel.world_size
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
        start = time.perf_counter()
        # Other nodes' ranks first (they wait in the join, not in a rendezvous with a timeout).
        joined = accept_nodes(config) if parallel.nnodes > 1 else None
        init_method = joined.init_method if joined else f"tcp://127.0.0.1:{free_port()}"
        self.remote: dict[int, RemoteRank] = joined.places if joined else {}
        node_ip = joined.node_ip if joined else None
        local = parallel.ranks_per_node
        threads = threads_per_rank(local)
        self.procs: list[BaseProcess] = []  # this node's ranks 0 .. local - 1
        self.conns: list[Connection] = []  # every rank's request channel, by rank: pipes, then sockets
        self._closed = False
        self._submitted = self._collected = 0  # steps sent with submit_model, and collected
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        try:
            for rank in range(local):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=worker_main,
                    args=(config, rank, init_method, threads, node_ip, os.getpid(), child_end),
                    name=f"pagedllm-{kind}{rank}",
                    daemon=True,
                )
                proc.start()  # from the constructing thread: PDEATHSIG follows that thread's life
                child_end.close()
                self.procs.append(proc)
                self.conns.append(parent_end)
        finally:  # the other nodes' sockets after the pipes: ``self.conns[rank]`` is rank's channel
            if joined:
                self.conns.extend(joined.conns[r] for r in sorted(joined.conns))
        try:
            answers = self._gather(_STARTUP_TIMEOUT_S, "start-up")
        except BaseException:
            self._abort()
            raise
        self.startup.add("worker processes", time.perf_counter() - start)
        for name, seconds in answers[0].items():  # rank 0's phases stand for all
            self.startup.add(f"rank 0 {name}", seconds)
        logger.info(
            "%s: %d worker processes here (pids %s)%s, %d intra-op thread(s) each",
            "pipeline parallel" if kind == "pp" else "tensor parallel",
            local,
            [p.pid for p in self.procs],
            f", {len(self.remote)} on other nodes {self._where_remote()}" if self.remote else "",
            threads,
        )

    def _where_remote(self) -> list[str]:
        return [f"rank {r}: {p.ip} pid {p.pid}" for r, p in sorted(self.remote.items())]

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

    def check_health(self) -> None:
        """Between steps (the engine core's idle loop): a rank that died, here or on another node
        (its connection closed), raises now rather than at the next request."""
        if self._closed:
            raise WorkerDiedError("the worker processes are shut down")
        for rank, conn in enumerate(self.conns):
            local_dead = rank < len(self.procs) and not self.procs[rank].is_alive()
            if local_dead or conn.poll():  # nothing is due between steps: readable means closed
                try:
                    stray = None if local_dead else conn.recv()
                except (EOFError, OSError):
                    stray = None
                error = self._died(rank, "an idle wait" if stray is None else f"an idle wait (sent {stray!r})")
                logger.error("%s; stopping the other ranks", error)
                self._abort()
                raise error

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
        collectives or transfers fail a moment later), or None. Another node's rank counts as
        exited when its connection is closed."""
        for peer, proc in enumerate(self.procs):
            if peer != rank:
                proc.join(0.05)  # a killed peer's exit is reaped within this
                if proc.exitcode is not None:
                    return peer
        for peer in self.remote:
            conn = self.conns[peer]
            if peer != rank and conn.poll(0.2):  # its node's FIN arrives about when gloo's reset does
                try:
                    conn.recv()
                except (EOFError, OSError):
                    return peer
        return None

    def _died(self, rank: int, what: str) -> WorkerDiedError:
        if rank in self.remote:
            place = self.remote[rank]
            return WorkerDiedError(
                f"worker rank {rank} on node {place.node_rank} ({place.ip}, pid {place.pid}) is gone during "
                f"{what!r} (its connection closed: the rank or its node died)"
            )
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
