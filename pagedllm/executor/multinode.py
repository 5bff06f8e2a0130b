"""Tensor / pipeline parallelism over several nodes without Ray (``--nnodes N --node-rank R
--distributed-init-method tcp://HOST:PORT``), as vLLM's multi-node multiprocessing.

Node 0 runs the server, the engine core and its ``tp x pp / N`` local ranks (``MultiprocExecutor``);
node R runs ``pagedllm serve MODEL ... --headless``, which starts only its ranks R*k .. R*k+k-1
(:func:`run_headless`). Node 0 listens at HOST:PORT (one of its own addresses). Each remote rank
connects there from its node's address (:func:`pagedllm.executor.net.node_ip`: never loopback
unless HOST is), proves it knows the protocol key, and says which rank it is and the sizes its node
was started with; once every rank has joined, node 0 sends each the engine's configuration and
the torch.distributed rendezvous (node 0's address, a free port). From then on the connection is
that rank's request channel, exactly like a local rank's pipe: each step's ``SchedulerOutput``
goes down it, and the rank's answer comes back (the output rank's ``ModelRunnerOutput``, None from
the others). gloo carries the collectives; the shared-memory all-reduce is off (it needs one host).

Crash safety: the connections use TCP keepalive. A remote rank whose connection closes without a
``shutdown`` (node 0 died) exits 1, and a rank inside a collective fails as soon as its peers'
sockets close (or at the step timeout); each rank dies with the headless process (PDEATHSIG), which
exits when any of its ranks does. On node 0, a remote rank's closed connection fails the step that
waits for it, or, between steps, the engine core's idle health check: the engine core exits, so
the server fails /health and exits 1.

The connection carries pickles: keep PORT on a trusted network (as torch.distributed's own ports).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import struct
import time
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from multiprocessing.process import BaseProcess
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.config.parallel import ParallelConfig, parse_init_method
from pagedllm.executor import WorkerDiedError, die_with_parent
from pagedllm.executor.net import free_port, node_ip, resolve, set_keepalive
from pagedllm.executor.rank import init_rank, run_rank, threads_per_rank

logger = logging.getLogger(__name__)

_AUTHKEY = b"pagedllm-nodes-v1"  # not a secret: tells a pagedllm rank from a stray connection
_JOIN_TIMEOUT_S = 300.0  # how long node 0 waits for the other nodes (and they for node 0)
_HELLO_TIMEOUT_S = 10.0  # a connection that does not finish its handshake in this is dropped
_RETRY_S = 0.5
_STOP_GRACE_S = 10.0
_FOLLOW_S = 2.0  # after a rank failed, how long the others get to report why they stop


@dataclass(frozen=True)
class RemoteRank:
    """Where a rank of another node runs, as node 0 saw it connect."""

    node_rank: int
    ip: str
    pid: int


@dataclass
class Joined:
    """Node 0's view once every remote rank has joined."""

    node_ip: str
    init_method: str  # the torch.distributed rendezvous: node 0's address, a free port
    places: dict[int, RemoteRank] = field(default_factory=dict)
    conns: dict[int, Connection] = field(default_factory=dict)


def _hello(parallel: ParallelConfig) -> dict[str, int]:
    return {
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "nnodes": parallel.nnodes,
    }


# ---------------------------------------------------------------------------------------- node 0
def accept_nodes(config: EngineConfig) -> Joined:
    """Node 0: wait until every other node's ranks have joined, then send each its start-up."""
    parallel = config.parallel_config
    ip = node_ip(parallel)
    _, port = parse_init_method(parallel.distributed_init_method or "")
    try:
        server = socket.create_server((ip, port))
    except OSError as e:
        raise ValueError(
            f"node 0 cannot listen on {ip}:{port} (--distributed-init-method): {e.strerror}; pick another port"
        ) from None
    joined = Joined(ip, f"tcp://{ip}:{free_port(ip)}")
    expected = parallel.world_size - parallel.ranks_per_node
    logger.info(
        "node 0 (%s): waiting for %d rank(s) of nodes 1..%d at port %d", ip, expected, parallel.nnodes - 1, port
    )
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    try:
        with server:
            while len(joined.conns) < expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerDiedError(_missing(parallel, joined, port))
                server.settimeout(left)
                try:
                    sock, addr = server.accept()
                except TimeoutError:
                    continue
                _admit(sock, addr[0], parallel, joined)
        for conn in joined.conns.values():
            conn.send((True, (config, joined.init_method)))
    except BaseException:
        for conn in joined.conns.values():
            conn.close()
        raise
    return joined


def _missing(parallel: ParallelConfig, joined: Joined, port: int) -> str:
    k = parallel.ranks_per_node
    nodes = sorted({r // k for r in range(k, parallel.world_size) if r not in joined.conns})
    return (
        f"node(s) {nodes} did not join within {_JOIN_TIMEOUT_S:.0f} s: start each with `pagedllm serve MODEL "
        f"--tensor-parallel-size {parallel.tensor_parallel_size} --pipeline-parallel-size "
        f"{parallel.pipeline_parallel_size} --nnodes {parallel.nnodes} --node-rank R --distributed-init-method "
        f"tcp://{joined.node_ip}:{port} --headless`, and check that it can reach {joined.node_ip}:{port}"
    )


def _admit(sock: socket.socket, peer: str, parallel: ParallelConfig, joined: Joined) -> None:
    """One connection: authenticate it, read which rank it is, check that its node's sizes match."""
    sock.setblocking(True)
    set_keepalive(sock)
    _recv_timeout(sock, _HELLO_TIMEOUT_S)  # a stray client cannot stall the join
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, _AUTHKEY)
        answer_challenge(conn, _AUTHKEY)
        hello = conn.recv()
        rank, node, pid = int(hello.pop("rank")), int(hello.pop("node_rank")), int(hello.pop("pid"))
    except Exception as e:  # noqa: BLE001 (anything a stranger may send)
        logger.warning("node 0: dropped a connection from %s that is not a pagedllm rank (%s)", peer, e)
        conn.close()
        return
    _recv_timeout_fd(conn.fileno(), 0)
    error = None
    if hello != _hello(parallel):
        error = (
            f"node {node} was started with {_sizes(hello)} but node 0 runs {_sizes(_hello(parallel))}: "
            "start every node with the same sizes"
        )
    elif rank in joined.conns:
        first = joined.places[rank]
        error = f"rank {rank} joined twice, from {first.ip} and {peer}: give each node its own --node-rank (1..N-1)"
    if error is not None:
        conn.send((False, error))
        conn.close()
        raise ValueError(error)
    joined.conns[rank], joined.places[rank] = conn, RemoteRank(node, peer, pid)
    logger.info("node 0: rank %d joined from node %d (%s, pid %d)", rank, node, peer, pid)


def _sizes(hello: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in hello.items())


def _recv_timeout(sock: socket.socket, seconds: float) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), 0))


def _recv_timeout_fd(fd: int, seconds: float) -> None:
    with socket.socket(fileno=os.dup(fd)) as s:  # the same socket: its options are shared
        _recv_timeout(s, seconds)


# ---------------------------------------------------------------------------------------- node R
def join_head(parallel: ParallelConfig, rank: int, ip: str) -> tuple[Connection, EngineConfig, str]:
    """A remote rank: connect to node 0 from this node's address (retrying until node 0 is up),
    say who we are, and wait for every node to join: (the connection, the engine's configuration,
    the rendezvous). A ValueError when node 0 refuses us (sizes that do not match, ...)."""
    host, port = parse_init_method(parallel.distributed_init_method or "")
    head = resolve(host)
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    while True:
        try:
            sock = socket.create_connection((head, port), timeout=_HELLO_TIMEOUT_S, source_address=(ip, 0))
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"node 0 did not answer at {head}:{port} within {_JOIN_TIMEOUT_S:.0f} s ({e}): start it, "
                    "or check the --distributed-init-method address"
                ) from None
            time.sleep(_RETRY_S)
    sock.settimeout(None)
    set_keepalive(sock)
    conn = Connection(sock.detach())
    answer_challenge(conn, _AUTHKEY)
    deliver_challenge(conn, _AUTHKEY)
    conn.send({"rank": rank, "node_rank": parallel.node_rank, "pid": os.getpid(), **_hello(parallel)})
    ok, payload = conn.recv()  # once every node has joined
    if not ok:
        conn.close()
        raise ValueError(f"node 0 refused rank {rank}: {payload}")
    config, init_method = payload
    return conn, config, init_method


def remote_rank_main(parallel: ParallelConfig, rank: int, threads: int, ip: str, parent_pid: int) -> None:
    """A headless node's rank (a process of its own): join node 0, then serve its requests."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the headless process decides when we stop
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s [node{parallel.node_rank} rank{rank}] %(message)s"
    )
    try:
        conn, config, init_method = join_head(parallel, rank, ip)
    except ValueError as e:
        logger.error("%s", e)
        raise SystemExit(2) from None
    except (OSError, EOFError) as e:
        logger.error("rank %d could not join node 0: %s", rank, e)
        raise SystemExit(1) from None
    if run_rank(
        conn, config, rank, partial(init_rank, config, rank, parallel.world_size, init_method, threads, False, ip)
    ):
        raise SystemExit(0)
    logger.error("rank %d: node 0 closed the connection without a shutdown (it died, or the step failed)", rank)
    raise SystemExit(1)


class _Stop(Exception):
    """SIGTERM / SIGINT to the headless process."""


def run_headless(parallel: ParallelConfig) -> int:
    """``pagedllm serve ... --headless`` on node R: start its ranks and wait for them. Exit code 0
    when node 0 shut down (or after SIGTERM / SIGINT), 2 when node 0 refused this node's settings,
    1 when node 0 died or a rank failed. Every rank exits with this process."""
    ip = node_ip(parallel)
    k = parallel.ranks_per_node
    ranks = range(parallel.node_rank * k, (parallel.node_rank + 1) * k)
    threads = threads_per_rank(k)
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []

    def stop(signum: int, frame: Any) -> None:
        raise _Stop

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        for rank in ranks:
            proc = ctx.Process(
                target=remote_rank_main,
                args=(parallel, rank, threads, ip, os.getpid()),
                name=f"pagedllm-node{parallel.node_rank}-rank{rank}",
                daemon=True,
            )
            proc.start()  # from the main thread: PDEATHSIG follows this thread's life
            procs.append(proc)
        logger.info(
            "node %d of %d (%s): ranks %d..%d (pids %s) join node 0 at %s",
            parallel.node_rank,
            parallel.nnodes,
            ip,
            ranks[0],
            ranks[-1],
            [p.pid for p in procs],
            parallel.distributed_init_method,
        )
        return _supervise(procs)
    except _Stop:
        logger.info("node %d: stopping its ranks", parallel.node_rank)
        return 0
    finally:
        _reap(procs)


def _supervise(procs: list[BaseProcess]) -> int:
    """Wait for the ranks; the first to fail stops the others. Exit code as :func:`run_headless`."""
    codes: list[int] = []
    alive = list(procs)
    while alive:
        # After one exit the others follow at once (the same shutdown, or the same refusal)
        timeout = None if not codes else _FOLLOW_S if any(codes) else _STOP_GRACE_S
        done = wait([p.sentinel for p in alive], timeout)
        if not done:
            break
        for proc in [p for p in alive if p.sentinel in done]:
            proc.join()
            alive.remove(proc)
            codes.append(proc.exitcode if proc.exitcode is not None else 1)
    failed = [c for c in codes if c]
    if not failed:
        return 0 if not alive else 1
    return 2 if 2 in failed else 1


def _reap(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(_STOP_GRACE_S / 2)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
