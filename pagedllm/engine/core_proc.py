"""The engine core in its own process: a busy loop of (drain inputs, step, send outputs).

Messages are msgspec-encoded over ZMQ. Inputs: (kind, payload) where kind is "add",
"abort" or "utility". Outputs: ``EngineCoreOutputs``, or a utility reply.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineConfig
from pagedllm.engine.protocol import EngineCoreRequest

logger = logging.getLogger(__name__)


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreProc:
    """Wraps an EngineCore with the socket loop."""

    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str) -> None:
        from pagedllm.engine.core import EngineCore

        self.core = EngineCore(config)
        self.core.structured_output_manager.compiler.warm_up()
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.connect(output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.stats_dirty = False
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)

    def run(self) -> None:
        while True:
            self._drain_inputs(block=not self.core.has_unfinished_requests())
            if self.core.has_unfinished_requests() or self.stats_dirty:
                # A step with no work still reports fresh stats (e.g. after aborts emptied the engine).
                self.stats_dirty = False
                self._send(("outputs", self.core.step()))

    def _drain_inputs(self, block: bool) -> None:
        timeout = 1000 if block else 0  # ms; blocking waits still wake up to stay responsive
        while self.poller.poll(timeout):
            kind, payload = msgspec.msgpack.decode(self.input.recv())
            self._handle(kind, payload)
            timeout = 0

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            self.core.add_request(msgspec.convert(payload, EngineCoreRequest))
        elif kind == "abort":
            self.core.abort_requests(payload)
            self.stats_dirty = True
        elif kind == "utility":
            self._utility(*payload)
        elif kind == "shutdown":
            raise SystemExit(0)

    def _utility(self, call_id: int, name: str, args: list) -> None:
        try:
            result = getattr(self, f"utility_{name}")(*args)
            reply = UtilityResult(call_id, result)
        except Exception as exc:  # reported to the caller, the loop goes on
            reply = UtilityResult(call_id, error=f"{type(exc).__name__}: {exc}")
        self._send(("utility", reply))

    def _send(self, message: tuple[str, Any]) -> None:
        self.output.send(self.encoder.encode(message), copy=False)

    # ------------------------------------------------------------------ utilities
    def utility_ping(self) -> str:
        return "pong"

    def utility_check_integrity(self) -> bool:
        self.core.check_integrity()
        return True

    def utility_reset_prefix_cache(self) -> bool:
        return self.core.scheduler.kv_cache_manager.reset_prefix_cache()

    def utility_capacity(self) -> dict:
        return {"num_blocks": self.core.num_blocks, "summary": self.core.capacity_summary(),
                "startup_seconds": self.core.startup_seconds}


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, ready_conn: Any,
                    parent_pid: int) -> None:
    """Process entry point. Reports ready (or the start-up error) through ``ready_conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    _die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [engine] %(message)s")
    try:
        proc = EngineCoreProc(config, input_addr, output_addr)
    except Exception as exc:
        ready_conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1)
    ready_conn.send({"ok": True, **proc.utility_capacity()})
    ready_conn.close()
    proc.run()


def _die_with_parent(parent_pid: int) -> None:
    """No orphan engines: on Linux, get SIGKILL when the front end dies."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:
        raise SystemExit(1)
