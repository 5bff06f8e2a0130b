"""Front-end side of the engine-core process: start it, talk to it over ZMQ, watch it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import uuid
from collections import OrderedDict
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from pagedllm.config import EngineConfig
from pagedllm.engine.core_proc import run_engine_core
from pagedllm.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityResult,
)
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.compiler import GrammarTimeoutError

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 600
_CONNECT_TIMEOUT_S = 30  # after it reported ready, the engine's I/O threads connect at once


# As many as the engine's compiler keeps compiled (structured_output/compiler.py): an accepted
# constraint the engine has since dropped is compiled again there, off the step loop.
_ACCEPTED_GRAMMARS = 512


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; in-flight requests cannot complete."""


class AsyncMPClient:
    """Runs ``EngineCoreProc`` in a child process and exchanges msgspec messages with it."""

    def __init__(self, config: EngineConfig, engine_index: int = 0, wait: bool = True) -> None:
        """Start the engine process. ``wait=False`` returns once it is spawned: the caller then
        calls ``wait_ready()`` (data parallelism spawns every engine core first, from this
        thread, since PR_SET_PDEATHSIG follows the spawning thread, then waits for them all)."""
        self.engine_index = engine_index
        # A private directory (mode 0700: no other user can connect), emptied and removed as soon
        # as the engine has connected (``_remove_ipc_dir``): a SIGKILLed server leaves no socket files.
        self.ipc_dir = tempfile.mkdtemp(prefix="pagedllm-ipc-")
        self.input_addr, self.output_addr = f"ipc://{self.ipc_dir}/in", f"ipc://{self.ipc_dir}/out"
        self.ctx = zmq.asyncio.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.bind(self.input_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(self.output_addr)
        self._watchers = [_AcceptWatcher(self.ctx, sock) for sock in (self.input, self.output)]
        self.encoder = msgspec.msgpack.Encoder()
        self.decoders: dict[EngineCoreOutputType, msgspec.msgpack.Decoder[Any]] = {
            EngineCoreOutputType.OUTPUTS: msgspec.msgpack.Decoder(EngineCoreOutputs),
            EngineCoreOutputType.UTILITY: msgspec.msgpack.Decoder(UtilityResult),
        }
        self.grammar_timeout_s = config.structured_outputs_config.compile_timeout_s
        # Constraints the engine accepted (most recent last): a request that repeats one, or the
        # second check of the same request (the handler's, then add_request's), costs no round trip.
        self._accepted_grammars: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.capacity: dict = {}
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future] = {}
        try:
            self.proc, self._ready_reader = self._spawn(config)
        except BaseException:
            self._stop_watching()
            raise
        if wait:
            self.wait_ready()

    def _spawn(self, config: EngineConfig) -> tuple[multiprocessing.context.SpawnProcess, Any]:
        ctx = multiprocessing.get_context("spawn")  # fork after torch threads start is unsafe
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=run_engine_core,
            name=f"pagedllm-engine-core-{self.engine_index}",
            daemon=True,
            args=(config, self.input_addr, self.output_addr, writer, os.getpid(), self.engine_index),
        )
        proc.start()
        writer.close()
        return proc, reader

    def wait_ready(self) -> None:
        """Wait until the engine reported ready and connected its sockets (then the socket files
        go); raises if it failed to start."""
        try:
            self.capacity = self._await_ready()
            if all(w.wait_accepted(time.monotonic() + _CONNECT_TIMEOUT_S) for w in self._watchers):
                self._remove_ipc_dir()  # connected: the paths are needed no more
            else:
                logger.warning(
                    "the engine did not connect within %g s; its sockets stay in %s", _CONNECT_TIMEOUT_S, self.ipc_dir
                )
        finally:
            self._stop_watching()

    def _stop_watching(self) -> None:
        """Start-up is over (or failed): close the connection watchers; a failed start leaves no files."""
        for watcher in self._watchers:
            watcher.close()
        self._watchers = []
        if not self.capacity:
            self._remove_ipc_dir()

    def _await_ready(self) -> dict:
        proc, reader = self.proc, self._ready_reader
        if not reader.poll(_START_TIMEOUT_S):
            proc.kill()
            raise RuntimeError(f"the engine core did not start within {_START_TIMEOUT_S} s")
        try:
            ready = reader.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(f"the engine core exited during start-up (exit code {proc.exitcode})") from None
        finally:
            reader.close()
        if "error" in ready:
            proc.join(5)
            raise ValueError(f"the engine failed to start: {ready['error']}")
        return ready

    @property
    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def death_summary(self) -> str:
        return f"the engine core process died (exit code {self.proc.exitcode})"

    def engine_of(self, request_id: str) -> int:
        """The engine core that runs ``request_id``: this one."""
        return self.engine_index

    async def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        await self.input.send_multipart([kind.value, self.encoder.encode(payload)], copy=False)

    async def add_request(self, request: EngineCoreRequest) -> None:
        await self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(EngineCoreRequestType.ABORT, list(request_ids))

    async def call_utility(self, name: str, *args: Any) -> Any:
        """Run ``utility_<name>`` in the engine process between steps and return its result."""
        call_id, future = self._new_call()
        await self._send(EngineCoreRequestType.UTILITY, (call_id, name, list(args)))
        return await future

    async def check_grammar(self, params: StructuredOutputsParams) -> None:
        """Have the engine compile ``params`` (off its busy loop): the one compile of a server's
        constraint, which the engine keeps for the request that follows. ValueError (the front
        end's 400) if it is invalid or does not compile within the time limit."""
        key = params.key()
        if key in self._accepted_grammars:
            self._accepted_grammars.move_to_end(key)
            return
        call_id, future = self._new_call()
        await self._send(EngineCoreRequestType.CHECK_GRAMMAR, (call_id, params))
        try:
            message = await asyncio.wait_for(future, self.grammar_timeout_s)
        except asyncio.TimeoutError:
            self._pending_calls.pop(call_id, None)  # a late verdict is dropped
            raise GrammarTimeoutError(params.kind, self.grammar_timeout_s) from None
        if message is not None:
            raise ValueError(message)
        self._accepted_grammars[key] = None
        if len(self._accepted_grammars) > _ACCEPTED_GRAMMARS:
            self._accepted_grammars.popitem(last=False)

    def _new_call(self) -> tuple[int, asyncio.Future]:
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = future
        return call_id, future

    async def get_output(self, timeout: float) -> EngineCoreOutputs | None:
        """The next step's outputs, or None when nothing arrived within ``timeout`` seconds."""
        while await self.output.poll(timeout=int(timeout * 1000)):
            frames = await self.output.recv_multipart(copy=False)
            try:
                kind = EngineCoreOutputType(frames[0].bytes)
            except ValueError:
                logger.error("unknown engine output kind %r; ignored", frames[0].bytes)
                continue
            payload = self.decoders[kind].decode(frames[1].buffer)
            if kind is EngineCoreOutputType.OUTPUTS:
                return payload
            self._resolve_utility(payload)
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
        self._remove_ipc_dir()

    def _remove_ipc_dir(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


class _AcceptWatcher:
    """Tells when a bound socket has accepted a connection (a ZMQ socket monitor, read through a
    blocking shadow of the asyncio context, since the client starts before any event loop runs)."""

    def __init__(self, ctx: zmq.asyncio.Context, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock
        addr = f"inproc://pagedllm-monitor-{uuid.uuid4().hex}"
        sock.monitor(addr, zmq.EVENT_ACCEPTED)
        self.reader: zmq.Socket = zmq.Context.shadow(ctx.underlying).socket(zmq.PAIR)
        self.reader.connect(addr)  # before the engine starts: an unread event would be dropped

    def wait_accepted(self, deadline: float) -> bool:
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            if self.reader.poll(left_ms) and recv_monitor_message(self.reader)["event"] == zmq.EVENT_ACCEPTED:
                return True
        return False

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.reader.close(linger=0)
