"""Front-end side of the engine-core process: start it, talk to it over ZMQ, watch it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import tempfile
import uuid
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagedllm.config import EngineConfig
from pagedllm.engine.core_proc import UtilityResult, run_engine_core
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 600


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; in-flight requests cannot complete."""


class AsyncMPClient:
    """Runs ``EngineCoreProc`` in a child process and exchanges msgspec messages with it."""

    def __init__(self, config: EngineConfig) -> None:
        base = os.path.join(tempfile.gettempdir(), f"pagedllm-{uuid.uuid4().hex[:12]}")
        self.input_addr, self.output_addr = f"ipc://{base}-in", f"ipc://{base}-out"
        self.ctx = zmq.asyncio.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.bind(self.input_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(self.output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(tuple[str, Any])
        self.capacity: dict = {}
        self.proc = self._start_process(config)
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future] = {}

    def _start_process(self, config: EngineConfig) -> multiprocessing.Process:
        ctx = multiprocessing.get_context("spawn")  # fork after torch threads start is unsafe
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=run_engine_core, name="pagedllm-engine-core", daemon=True,
                           args=(config, self.input_addr, self.output_addr, writer, os.getpid()))
        proc.start()
        writer.close()
        if not reader.poll(_START_TIMEOUT_S):
            proc.kill()
            raise RuntimeError(f"the engine core did not start within {_START_TIMEOUT_S} s")
        try:
            ready = reader.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(f"the engine core exited during start-up (exit code {proc.exitcode})") from None
        if "error" in ready:
            proc.join(5)
            raise ValueError(f"the engine failed to start: {ready['error']}")
        self.capacity = ready
        return proc

    @property
    def is_alive(self) -> bool:
        return self.proc.is_alive()

    async def _send(self, kind: str, payload: Any) -> None:
        await self.input.send(self.encoder.encode((kind, payload)), copy=False)

    async def add_request(self, request: EngineCoreRequest) -> None:
        await self._send("add", request)

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send("abort", list(request_ids))

    async def call_utility(self, name: str, *args: Any) -> Any:
        """Run ``utility_<name>`` in the engine process between steps and return its result."""
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = future
        await self._send("utility", (call_id, name, list(args)))
        return await future

    async def get_output(self, timeout: float) -> EngineCoreOutputs | None:
        """The next step's outputs, or None when nothing arrived within ``timeout`` seconds."""
        while await self.output.poll(timeout=int(timeout * 1000)):
            kind, payload = self.decoder.decode(await self.output.recv())
            if kind == "outputs":
                return msgspec.convert(payload, EngineCoreOutputs)
            self._resolve_utility(msgspec.convert(payload, UtilityResult))
        return None

    def _resolve_utility(self, reply: UtilityResult) -> None:
        future = self._pending_calls.pop(reply.call_id, None)
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(RuntimeError(reply.error))
        else:
            future.set_result(reply.result)

    def fail_pending_calls(self, error: Exception) -> None:
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(error)
        self._pending_calls.clear()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process (SIGTERM, then SIGKILL) and close the sockets."""
        if self.proc.is_alive():
            self.proc.terminate()  # the engine keeps no state worth a graceful stop
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout)
        self.ctx.destroy(linger=0)
        for addr in (self.input_addr, self.output_addr):
            try:
                os.unlink(addr[len("ipc://"):])
            except OSError:
                pass
