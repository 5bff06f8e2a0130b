"""The engine core in its own process: a busy loop of (take inputs, step, hand over outputs).

Socket I/O and (de)serialization run on two threads of their own, so they overlap the step:
the input thread receives and msgspec-decodes each message into ``input_queue``; the output
thread encodes and sends what the busy loop puts on ``output_queue``. The busy loop only moves
Python objects. Each ZMQ socket is created, used and closed by its one thread. Messages are
two frames, kind and payload (see ``engine/protocol.py``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import queue
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, cast

import msgspec
import zmq

from pagedllm.config import EngineConfig
from pagedllm.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    UtilityResult,
)
from pagedllm.executor import die_with_parent
from pagedllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.engine.core import EngineCore

logger = logging.getLogger(__name__)

_IDLE_WAKE_S = 1.0  # an idle busy loop still wakes up this often
_THREAD_POLL_MS = 100  # how often the input thread checks that it should stop
_JOIN_S = 5.0

# The payload type of each input kind: decoded straight into it, no second conversion.
_PAYLOAD_TYPES: dict[EngineCoreRequestType, Any] = {
    EngineCoreRequestType.ADD: EngineCoreRequest,
    EngineCoreRequestType.ABORT: list[str],
    EngineCoreRequestType.UTILITY: tuple[int, str, list],
    EngineCoreRequestType.CHECK_GRAMMAR: tuple[int, StructuredOutputsParams],
    EngineCoreRequestType.SHUTDOWN: Any,
}


class _ThreadFailed:
    """Put on the input queue by an I/O thread that died, so the busy loop fails too."""

    def __init__(self, name: str, exc: BaseException) -> None:
        self.message = f"the engine's {name} thread failed: {type(exc).__name__}: {exc}"


_STOP = object()  # output-queue sentinel


class EngineCoreProc:
    """Wraps an EngineCore with the socket threads and the busy loop."""

    def __init__(self, core: EngineCore, input_addr: str, output_addr: str) -> None:
        self.core = core
        self.stats_dirty = False
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self._ctx = zmq.Context()
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._guard,
                args=("input", self._input_loop, input_addr),
                name="pagedllm-engine-input",
                daemon=True,
            ),
            threading.Thread(
                target=self._guard,
                args=("output", self._output_loop, output_addr),
                name="pagedllm-engine-output",
                daemon=True,
            ),
        ]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ busy loop
    def run(self) -> None:
        """Serve until a SHUTDOWN message; an exception (a failed step or I/O thread) ends it too."""
        while self._process_input_queue(block=not self.core.has_unfinished_requests()):
            if self.core.has_unfinished_requests() or self.stats_dirty:
                # A step with no work still reports fresh stats (e.g. after aborts emptied the engine).
                self.stats_dirty = False
                self.output_queue.put((EngineCoreOutputType.OUTPUTS, self.core.step()))
            else:  # idle (woken at least every _IDLE_WAKE_S): a dead rank must not wait for a request
                self.core.check_health()

    def _process_input_queue(self, block: bool) -> bool:
        """Handle every queued input (waiting for one when ``block``); False on SHUTDOWN."""
        while True:
            try:
                item = self.input_queue.get(timeout=_IDLE_WAKE_S) if block else self.input_queue.get_nowait()
            except queue.Empty:
                return True
            if isinstance(item, _ThreadFailed):
                raise RuntimeError(item.message)
            kind, payload = item
            if kind is EngineCoreRequestType.SHUTDOWN:
                return False
            self._handle(kind, payload)
            block = False

    def _handle(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if kind is EngineCoreRequestType.ADD:
            self._add(payload)
        elif kind is EngineCoreRequestType.ABORT:
            self.core.abort_requests(payload)
            self.stats_dirty = True
        elif kind is EngineCoreRequestType.UTILITY:
            self._utility(*payload)
        else:  # a kind the input thread queues but nobody handles: a bug, said loudly
            logger.error("engine message kind %s has no handler; dropped", kind.name)

    def _add(self, request: EngineCoreRequest) -> None:
        """Admit a request; one the engine cannot take fails alone (its client gets the error),
        never the engine and the requests in flight."""
        try:
            self.core.add_request(request)
        except Exception as exc:
            logger.exception("request %s could not be added; failed", request.request_id)
            self._fail_request(request.request_id, f"the engine could not take this request: {exc}")

    def _fail_request(self, request_id: str, message: str) -> None:
        failed = EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, stop_reason=message)
        self.output_queue.put((EngineCoreOutputType.OUTPUTS, EngineCoreOutputs(outputs=[failed])))

    def _utility(self, call_id: int, name: str, args: list) -> None:
        try:
            result = getattr(self, f"utility_{name}")(*args)
            reply = UtilityResult(call_id, result)
        except Exception as exc:  # reported to the caller, the loop goes on
            reply = UtilityResult(call_id, error=f"{type(exc).__name__}: {exc}")
        self.output_queue.put((EngineCoreOutputType.UTILITY, reply))

    # ------------------------------------------------------------------ I/O threads
    def _guard(self, name: str, loop: Any, addr: str) -> None:
        try:
            loop(addr)
        except Exception as exc:  # an engine that cannot talk must die visibly, not hang
            logger.exception("engine %s thread failed", name)
            self.input_queue.put(_ThreadFailed(name, exc))

    def _input_loop(self, addr: str) -> None:
        decoders = {kind: msgspec.msgpack.Decoder(t) for kind, t in _PAYLOAD_TYPES.items()}
        sock = self._ctx.socket(zmq.PULL)
        sock.connect(addr)
        try:
            while not self._stopping.is_set():
                if sock.poll(_THREAD_POLL_MS):
                    self._take_message(sock.recv_multipart(copy=False), decoders)
        finally:
            sock.close(linger=0)

    def _take_message(self, frames: list, decoders: dict) -> None:
        try:
            kind = EngineCoreRequestType(frames[0].bytes)
        except ValueError:
            logger.error("unknown engine message kind %r (%d frames); ignored", frames[0].bytes, len(frames))
            return
        if len(frames) < 2 and kind is not EngineCoreRequestType.SHUTDOWN:
            logger.error("engine message %s without a payload (%d frame); ignored", kind.name, len(frames))
            return
        try:
            payload = decoders[kind].decode(frames[1].buffer) if len(frames) > 1 else None
        except msgspec.DecodeError as exc:  # ValidationError too: a field the front end let through
            self._refuse_undecodable(kind, frames[1].buffer, exc)
            return
        if kind is EngineCoreRequestType.CHECK_GRAMMAR:
            # compiled off the busy loop; the reply skips it too
            self._check_grammar(*cast("tuple[int, StructuredOutputsParams]", payload))
        else:
            self.input_queue.put((kind, payload))

    def _refuse_undecodable(self, kind: EngineCoreRequestType, buffer: Any, exc: Exception) -> None:
        """A message that does not decode fails its own request or call (found by its leading
        field: the request id, or the call id), never the input thread and so the engine."""
        logger.error("undecodable %s message (%s); refused", kind.name, exc)
        message = f"the engine could not read this request: {exc}"
        try:
            ident = msgspec.msgpack.decode(buffer)[0]
        except Exception:  # not even a msgpack array: nobody to answer
            return
        if kind is EngineCoreRequestType.ADD and isinstance(ident, str):
            self._fail_request(ident, message)
        elif kind in (EngineCoreRequestType.UTILITY, EngineCoreRequestType.CHECK_GRAMMAR) and isinstance(ident, int):
            self.output_queue.put((EngineCoreOutputType.UTILITY, UtilityResult(ident, error=message)))

    def _check_grammar(self, call_id: int, params: StructuredOutputsParams) -> None:
        """Start compiling; the verdict goes out when done. The engine compiler's cache keeps the
        result, so the request that follows does not compile it again."""
        future = self.core.structured_output_manager.compiler.submit(params)
        future.add_done_callback(
            lambda f: self.output_queue.put((EngineCoreOutputType.UTILITY, _grammar_verdict(call_id, f)))
        )

    def _output_loop(self, addr: str) -> None:
        encoder = msgspec.msgpack.Encoder()
        sock = self._ctx.socket(zmq.PUSH)
        sock.connect(addr)
        try:
            while (item := self.output_queue.get()) is not _STOP:
                kind, payload = item
                sock.send_multipart([kind.value, encoder.encode(payload)], copy=False)
        finally:
            sock.close(linger=1000)  # what is already queued still goes out

    def shutdown(self) -> None:
        """Stop the I/O threads and close the context (the process exit does this for free)."""
        self._stopping.set()
        self.output_queue.put(_STOP)
        for thread in self._threads:
            thread.join(_JOIN_S)
        if not any(thread.is_alive() for thread in self._threads):
            self._ctx.term()

    # ------------------------------------------------------------------ utilities
    def utility_ping(self) -> str:
        return "pong"

    def utility_check_integrity(self) -> bool:
        self.core.check_integrity()
        return True

    def utility_reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.core.reset_prefix_cache(reset_running_requests)

    def utility_capacity(self) -> dict:
        return {
            "num_blocks": self.core.num_blocks,
            "summary": self.core.capacity_summary(),
            "startup_seconds": self.core.startup_seconds,
            "startup_phases": self.core.startup_phases,
        }


def _grammar_verdict(call_id: int, future: cf.Future) -> UtilityResult:
    """A CHECK_GRAMMAR answer: result None (compiled) or the ValueError's message (invalid)."""
    if future.cancelled():
        return UtilityResult(call_id, error="CancelledError: the compile was cancelled")
    exc = future.exception()
    if exc is None:
        return UtilityResult(call_id)
    if isinstance(exc, ValueError):
        return UtilityResult(call_id, result=str(exc))
    return UtilityResult(call_id, error=f"{type(exc).__name__}: {exc}")


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    ready_conn: Any,
    parent_pid: int,
    engine_index: int = 0,
) -> None:
    """Process entry point. Reports ready (or the start-up error) through ``ready_conn``.
    ``engine_index``: which of the ``data_parallel_size`` engine cores this is."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    die_with_parent(parent_pid)
    num_engines = config.parallel_config.data_parallel_size
    name = f"engine{engine_index}" if num_engines > 1 else "engine"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [{name}] %(message)s")
    if num_engines > 1:
        _share_cores(num_engines)
    try:
        from pagedllm.engine.core import EngineCore

        core = EngineCore(config)
        core.structured_output_manager.compiler.warm_up()
        proc = EngineCoreProc(core, input_addr, output_addr)
    except Exception as exc:
        ready_conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1) from exc
    ready_conn.send({"ok": True, **proc.utility_capacity()})
    ready_conn.close()
    try:
        proc.run()
    except Exception:
        logger.exception("the engine core failed; exiting")
        proc.shutdown()
        core.shutdown()
        # Everything is stopped; a background thread still busy (the grammar compiler's warm-up
        # importing transformers, measured at 13 s on a loaded machine) would hold a normal exit,
        # and with it the server's, so leave now.
        sys.stderr.flush()
        os._exit(1)
    proc.shutdown()
    core.shutdown()


def _share_cores(num_engines: int) -> None:
    """Data parallelism: each engine core gets ``usable cores // num_engines`` intra-op threads
    (at least one), the tensor-parallel split, since more threads than cores in all is a 7-8x
    slowdown. Set before the worker sizes its pool; a user's ``OMP_NUM_THREADS`` wins."""
    from pagedllm import envs
    from pagedllm.executor.rank import threads_per_rank

    if envs.omp_num_threads():
        return
    envs.set_omp_num_threads(threads_per_rank(num_engines))
    import torch

    torch.set_num_threads(int(envs.omp_num_threads()))
