"""EngineCoreProc in this process (its busy loop on a thread) behind real ZMQ sockets.

Covers the message kinds (an unknown one is a logged error and the engine goes on), the I/O
threads (decoding and sending overlap a step; a dead I/O thread fails the loop instead of
hanging it) and, through AsyncLLM, that a server compiles each constraint exactly once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import logging
import os
import tempfile
import threading
import time
import uuid
from types import SimpleNamespace
from typing import Any

import jsonschema
import msgspec
import pytest
import zmq

from pagedllm.config import EngineArgs
from pagedllm.engine.core_client import AsyncMPClient
from pagedllm.engine.core_proc import EngineCoreProc
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreOutputType, EngineCoreRequestType, UtilityResult
from pagedllm.sampling_params import SamplingParams

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
}


def _addrs() -> tuple[str, str]:
    base = os.path.join(tempfile.gettempdir(), f"pagedllm-test-{uuid.uuid4().hex[:12]}")
    return f"ipc://{base}-in", f"ipc://{base}-out"


class FrontEnd:
    """The front end's two sockets, bound like AsyncMPClient's, driven synchronously."""

    def __init__(self) -> None:
        self.input_addr, self.output_addr = _addrs()
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.bind(self.input_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(self.output_addr)

    def send(self, kind: bytes, payload: Any = None) -> None:
        self.input.send_multipart([kind, msgspec.msgpack.encode(payload)])

    def recv(self, timeout_s: float = 10.0) -> tuple[EngineCoreOutputType, Any]:
        assert self.output.poll(int(timeout_s * 1000)), "no message from the engine"
        kind_frame, payload = self.output.recv_multipart()
        kind = EngineCoreOutputType(kind_frame)
        typ = EngineCoreOutputs if kind is EngineCoreOutputType.OUTPUTS else UtilityResult
        return kind, msgspec.msgpack.decode(payload, type=typ)

    def recv_utility(self) -> UtilityResult:
        while True:
            kind, payload = self.recv()
            if kind is EngineCoreOutputType.UTILITY:
                return payload

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        for addr in (self.input_addr, self.output_addr):
            os.unlink(addr[len("ipc://") :])


class Running:
    """An EngineCoreProc with its busy loop on a thread; ``error`` is what ended the loop."""

    def __init__(self, core: Any, front: FrontEnd) -> None:
        self.proc = EngineCoreProc(core, front.input_addr, front.output_addr)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.proc.run()
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self.proc.input_queue.put((EngineCoreRequestType.SHUTDOWN, None))
        self.thread.join(10)
        self.proc.shutdown()
        assert not self.thread.is_alive()


class BlockingCore:
    """A fake engine core whose steps block until released: shows what runs during a step."""

    def __init__(self, steps: int = 0) -> None:
        self.in_step = threading.Event()
        self.release = threading.Event()
        self.pending = steps  # steps of work left
        done: cf.Future = cf.Future()
        done.set_result("compiled")
        compiler = SimpleNamespace(submit=lambda params: done)
        self.structured_output_manager = SimpleNamespace(compiler=compiler)

    def has_unfinished_requests(self) -> bool:
        return self.pending > 0

    def add_request(self, request: Any) -> None:
        self.pending += 1

    def check_health(self) -> None:
        """No ranks to lose: the idle loop's check passes."""

    def step(self) -> EngineCoreOutputs:
        self.in_step.set()
        assert self.release.wait(10)
        self.release.clear()
        self.pending -= 1
        return EngineCoreOutputs()


@pytest.fixture
def front():
    front = FrontEnd()
    yield front
    front.close()


@pytest.fixture(scope="module")
def config(llama_model_dir):
    return EngineArgs(model=str(llama_model_dir), max_model_len=256).create_engine_config()


@pytest.fixture(scope="module")
def core(config):
    from pagedllm.engine.core import EngineCore

    return EngineCore(config)


def _request(request_id: str, max_tokens: int = 4):
    from pagedllm.engine.protocol import EngineCoreRequest

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    params.all_stop_token_ids = set()
    return EngineCoreRequest(request_id, [1, 2, 3, 4], params, None)


def test_unknown_kind_is_logged_and_the_engine_keeps_serving(core, front, caplog):
    running = Running(core, front)
    try:
        with caplog.at_level(logging.ERROR, logger="pagedllm.engine.core_proc"):
            front.send(b"frobnicate", [1, 2])
            front.send(EngineCoreRequestType.UTILITY.value, (7, "ping", []))
            assert front.recv_utility() == UtilityResult(7, "pong")
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "frobnicate" in errors[0].getMessage()
        assert "unknown engine message kind" in errors[0].getMessage()
        front.send(EngineCoreRequestType.ADD.value, _request("r"))  # and requests still run
        tokens: list[int] = []
        while True:
            kind, payload = front.recv()
            if kind is EngineCoreOutputType.OUTPUTS and payload.outputs:
                tokens += payload.outputs[0].new_token_ids
                if payload.outputs[0].finished:
                    break
        assert len(tokens) == 4 and running.error is None
    finally:
        running.stop()
    core.check_integrity()


def test_decoding_and_sending_overlap_the_step(front):
    core = BlockingCore(steps=2)
    running = Running(core, front)
    try:
        assert core.in_step.wait(10)
        # During step 1: a message is received and decoded into the queue, and a grammar check
        # is answered at once.
        front.send(EngineCoreRequestType.UTILITY.value, (1, "ping", []))
        front.send(EngineCoreRequestType.CHECK_GRAMMAR.value, (2, {"regex": "a+"}))
        assert front.recv_utility() == UtilityResult(2, None)
        deadline = time.monotonic() + 10
        while running.proc.input_queue.qsize() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running.proc.input_queue.queue[0] == (EngineCoreRequestType.UTILITY, (1, "ping", []))
        core.in_step.clear()
        core.release.set()
        # During step 2: step 1's outputs and the ping's answer go out.
        assert core.in_step.wait(10)
        assert front.recv()[0] is EngineCoreOutputType.OUTPUTS
        assert front.recv_utility() == UtilityResult(1, "pong")
        core.release.set()
        assert front.recv()[0] is EngineCoreOutputType.OUTPUTS
    finally:
        core.release.set()
        running.stop()


def test_a_failed_io_thread_fails_the_loop(front, monkeypatch):
    def broken(self, frames, decoders):
        raise OSError("the socket broke")

    monkeypatch.setattr(EngineCoreProc, "_take_message", broken)
    running = Running(BlockingCore(), front)
    front.send(EngineCoreRequestType.UTILITY.value, (1, "ping", []))
    running.thread.join(10)
    assert isinstance(running.error, RuntimeError) and "input thread failed" in str(running.error)
    running.proc.shutdown()


class RankLostCore(BlockingCore):
    """An idle engine whose executor lost a rank (another node died) after ``healthy`` checks."""

    def __init__(self, healthy: int) -> None:
        super().__init__()
        self.checks, self.healthy = 0, healthy

    def check_health(self) -> None:
        self.checks += 1
        if self.checks > self.healthy:
            raise RuntimeError("worker rank 1 on node 1 is gone")


def test_an_idle_loop_fails_when_a_rank_is_gone(front):
    """No request needed: the idle loop checks the executor each time it wakes (every second)."""
    running = Running(RankLostCore(healthy=1), front)
    start = time.monotonic()
    running.thread.join(10)
    assert isinstance(running.error, RuntimeError) and "rank 1 on node 1" in str(running.error)
    assert 0.5 < time.monotonic() - start < 5  # the second wake, not a busy poll
    running.proc.shutdown()


# ---------------------------------------------------------------------------------- grammar once
@pytest.fixture
def compiles(monkeypatch) -> list[tuple[str, str]]:
    """Every compile of any XgrammarBackend in this process, front end and engine alike."""
    from pagedllm.structured_output.xgrammar_backend import XgrammarBackend

    seen: list[tuple[str, str]] = []
    real_compile = XgrammarBackend.compile

    def counting_compile(self, kind: str, spec: str):
        seen.append((kind, spec))
        return real_compile(self, kind, spec)

    monkeypatch.setattr(XgrammarBackend, "compile", counting_compile)
    return seen


def test_offline_compiles_each_constraint_once(llama_model_dir, compiles):
    from pagedllm import LLM

    llm = LLM(str(llama_model_dir), max_model_len=256)
    params = SamplingParams(max_tokens=60, n=2, temperature=1.0, seed=5, structured_outputs={"json": PERSON})
    for completion in llm.generate(["hi"], params)[0].outputs:
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert len(compiles) == 1


def test_a_server_compiles_each_constraint_once(config, core, compiles, monkeypatch):
    """Front end + engine, as in server mode (the msgspec round trip included): the API side's
    400 check and the request itself share one compile, done by the engine."""
    from pagedllm.engine import async_llm

    monkeypatch.setattr(async_llm, "AsyncMPClient", _thread_client(core))

    async def main() -> None:
        engine = async_llm.AsyncLLM(config)
        checks: list[Any] = []
        send = engine.client._send

        async def counting_send(kind, payload):
            if kind == EngineCoreRequestType.CHECK_GRAMMAR:
                checks.append(payload)
            await send(kind, payload)

        engine.client._send = counting_send
        try:
            params = SamplingParams(max_tokens=60, n=2, temperature=1.0, seed=3, structured_outputs={"json": PERSON})
            await engine.check_structured_outputs(params)  # the server's 400 check
            final = [o async for o in engine.generate("hi", params, "p")][-1]
            for completion in final.outputs:
                jsonschema.validate(json.loads(completion.text), PERSON)
            assert len(compiles) == 1
            assert len(checks) == 1  # generate's own check found the verdict: no second round trip
            bad = SamplingParams(max_tokens=8, structured_outputs={"json": {"type": "strnig"}})
            with pytest.raises(ValueError, match='invalid JSON schema: .*Unsupported type "strnig"'):
                await engine.check_structured_outputs(bad)
            with pytest.raises(ValueError, match='Unsupported type "strnig"'):
                await engine.add_request("bad", "hi", bad)
            assert len(compiles) == 2
            assert await engine.call_utility("check_integrity") is True
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_server_resets_the_prefix_cache_through_the_engine(config, core, monkeypatch):
    """AsyncLLM.reset_prefix_cache is a utility call into the engine process: refused while a
    request runs, done once it is preempted (it then recomputes to the same tokens) or idle."""
    from pagedllm.engine import async_llm

    monkeypatch.setattr(async_llm, "AsyncMPClient", _thread_client(core))
    prompt = {"prompt_token_ids": list(range(300, 340))}  # 2 full blocks can hit
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)

    async def cached(engine: Any, request_id: str) -> int:
        short = SamplingParams(temperature=0.0, max_tokens=1)
        return [o async for o in engine.generate(prompt, short, request_id)][-1].num_cached_tokens

    async def main() -> None:
        engine = async_llm.AsyncLLM(config)
        try:
            assert await engine.reset_prefix_cache() is True
            reference = [o async for o in engine.generate(prompt, params, "ref")][-1].outputs[0].token_ids
            assert await cached(engine, "hit") == 32
            stream = engine.generate(prompt, params, "running")
            await stream.__anext__()  # running: its blocks are held
            assert await engine.reset_prefix_cache() is False
            assert await engine.reset_prefix_cache(reset_running_requests=True) is True
            final = [o async for o in stream][-1]
            assert final.outputs[0].token_ids == reference
            assert await engine.reset_prefix_cache() is True
            assert await cached(engine, "miss") == 0
            assert await engine.call_utility("check_integrity") is True
        finally:
            engine.shutdown()

    asyncio.run(main())


def _thread_client(core: Any) -> type:
    """AsyncMPClient with the engine on a thread of this process instead of a child process."""

    class ThreadHandle:
        exitcode = None

        def __init__(self, running: Running) -> None:
            self.running = running

        def is_alive(self) -> bool:
            return self.running.thread.is_alive()

        def terminate(self) -> None:
            self.running.proc.input_queue.put((EngineCoreRequestType.SHUTDOWN, None))

        kill = terminate

        def join(self, timeout: float | None = None) -> None:
            self.running.thread.join(timeout)
            self.running.proc.shutdown()

    class ThreadClient(AsyncMPClient):
        def _spawn(self, config: Any) -> Any:
            front = SimpleNamespace(input_addr=self.input_addr, output_addr=self.output_addr)
            self.running = Running(core, front)  # type: ignore[arg-type]
            return ThreadHandle(self.running), None

        def _await_ready(self) -> dict:
            return self.running.proc.utility_capacity()

    return ThreadClient


def test_an_unknown_output_kind_is_logged_by_the_client(config, core, caplog):
    def logged() -> bool:
        return any("gossip" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)

    async def main() -> None:
        client = _thread_client(core)(config)
        # The ipc:// path is gone once the engine connected (nobody else may): a second endpoint
        # of the same output socket, in process, lets the rogue in.
        client.output.bind("inproc://rogue-output")
        ctx = zmq.Context.shadow(client.ctx.underlying)
        rogue = ctx.socket(zmq.PUSH)
        rogue.connect("inproc://rogue-output")
        try:
            rogue.send_multipart([b"gossip", b"\xc0"])
            deadline = time.monotonic() + 10
            with caplog.at_level(logging.ERROR, logger="pagedllm.engine.core_client"):
                while not logged() and time.monotonic() < deadline:
                    assert await client.get_output(timeout=0.1) is None
            assert logged()
            ping = asyncio.ensure_future(client.call_utility("ping"))  # the client goes on
            while not ping.done():
                await client.get_output(timeout=0.1)
            assert ping.result() == "pong"
        finally:
            rogue.close(linger=0)
            client.shutdown()

    asyncio.run(main())


def _finished(front: FrontEnd, request_id: str) -> Any:
    """The engine's final output for ``request_id`` (other outputs skipped)."""
    while True:
        kind, payload = front.recv()
        if kind is EngineCoreOutputType.OUTPUTS:
            for out in payload.outputs:
                if out.request_id == request_id and out.finished:
                    return out


class Refusing:
    """The real engine core, except that adding request "boom" raises (a bug's stand-in)."""

    def __init__(self, core: Any) -> None:
        self._core = core

    def add_request(self, request: Any) -> None:
        if request.request_id == "boom":
            raise RuntimeError("cannot take it")
        self._core.add_request(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)


def test_a_request_the_engine_cannot_read_or_add_fails_alone(core, front, caplog):
    """An ADD whose payload does not decode (a field the front end let through) and one whose
    admission raises each fail their own request with an error; the engine keeps serving."""
    from pagedllm.engine.protocol import FinishReason

    running = Running(Refusing(core), front)
    try:
        with caplog.at_level(logging.ERROR, logger="pagedllm.engine.core_proc"):
            front.send(EngineCoreRequestType.ADD.value, ["garbled", "not token ids", None, None])
            garbled = _finished(front, "garbled")
            front.send(EngineCoreRequestType.ADD.value, _request("boom"))
            boom = _finished(front, "boom")
            front.send(EngineCoreRequestType.UTILITY.value, (9, "ping"))  # too short for (id, name, args)
            refused_call = front.recv_utility()
            front.input.send_multipart([EngineCoreRequestType.ADD.value, b"\xc1 not msgpack"])  # no one to tell
            front.input.send_multipart([EngineCoreRequestType.ADD.value])  # no payload at all
        assert garbled.finish_reason == FinishReason.ERROR and "could not read this request" in garbled.stop_reason
        assert boom.finish_reason == FinishReason.ERROR and "cannot take it" in boom.stop_reason
        assert refused_call.call_id == 9 and "could not read" in refused_call.error
        front.send(EngineCoreRequestType.ADD.value, _request("fine"))
        assert _finished(front, "fine").finish_reason == FinishReason.LENGTH
        assert running.error is None and running.thread.is_alive()
    finally:
        running.stop()
    core.check_integrity()
