"""``pagedllm serve``'s process supervision: bind, start the engine process, run uvicorn, watch
the engine, handle signals, drain.

Exit codes: 0 after SIGTERM/SIGINT (in-flight requests drained up to --shutdown-timeout),
1 if the engine process died, 2 on start-up errors.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import time
from typing import Any

import pagedllm
from pagedllm.entrypoints.openai.api_keys import describe_keys
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.engine_client import EngineClient
from pagedllm.entrypoints.openai.server_options import ServerOptions
from pagedllm.entrypoints.openai.server_state import ServerState
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.startup import StartupPhases

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.2  # how often the front end checks that the engine process is alive
DEAD_ENGINE_GRACE_S = 2.0  # after engine death, in-flight connections get this long to close


def run_server(args: argparse.Namespace, started: float | None = None) -> int:
    """``pagedllm serve``. Exit code: 0 after SIGTERM/SIGINT, 1 if the engine died, 2 on start-up errors.
    ``started``: the ``time.perf_counter()`` the start-up is counted from (default: now)."""
    _setup_logging()
    phases = StartupPhases()
    started = time.perf_counter() if started is None else started
    phases.add("imports", time.perf_counter() - started)
    try:
        options = ServerOptions.from_args(args)
        sock = _bind_socket(args.host, args.port)
        from pagedllm.demo.demo_model import with_demo_model
        from pagedllm.entrypoints.cli_args import engine_args_from_namespace

        with phases.phase("model and config"):  # the demo model is built here on first use
            config = with_demo_model(engine_args_from_namespace(args)).create_engine_config(usage_context="serve")
        if not getattr(args, "served_model_name", None):  # the default model's name (SmolLM2 or the demo)
            args.served_model_name = [config.model_config.served_model_name]
            options = ServerOptions.from_args(args)  # build_app reads the names from args too
    except (ValueError, OSError) as exc:
        _startup_error(exc)
        return 2
    code = asyncio.run(_serve(args, options, config, sock, phases, started))
    # The process exits next, with the engine already stopped: the interpreter's final garbage
    # collection over the front end's heap (torch, transformers) took 5 s on a loaded 2-core
    # machine, measured, and frees nothing that matters. Freezing it out keeps a dead engine's
    # server exit (and a SIGTERM drain's) to about a second.
    gc.freeze()
    return code


async def _serve(
    args: argparse.Namespace, options: ServerOptions, config: Any, sock: Any, phases: StartupPhases, started: float
) -> int:
    import uvicorn

    from pagedllm.entrypoints.openai.http_protocol import h11_protocol

    try:
        engine = _start_engine(config, options, phases)
    except (ValueError, RuntimeError, OSError) as exc:
        sock.close()
        _startup_error(exc)
        return 2
    try:
        with phases.phase("app"):
            app = build_app(engine, args)
    except BaseException:
        engine.shutdown()
        raise
    state: ServerState = app.state.server_state
    watchdog = None
    try:
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
                timeout_graceful_shutdown=args.shutdown_timeout,
                timeout_keep_alive=options.limits.timeout_keep_alive,
                http=h11_protocol(options.limits.header_read_timeout),
                lifespan="on",
            )
        )
        _print_startup(engine, options, args, phases, started)
        _install_signal_handlers(server)
        watchdog = asyncio.create_task(watch_engine(state, server))
        await server.serve(sockets=[sock])
    finally:
        if watchdog is not None:
            watchdog.cancel()
        state.stop_engine()  # normally the lifespan has done this already
    logger.info("server stopped (exit code %d)", state.exit_code)
    return state.exit_code


async def watch_engine(state: ServerState, server: Any) -> None:
    """Engine death: fail in-flight requests, report not-ready, stop ``server`` (a uvicorn.Server)
    with exit code 1. An engine shut down on purpose (the app stopping) is not a death."""
    while state.engine.is_running:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
    if state.engine_stopped:
        return
    state.engine_dead = True
    state.exit_code = 1
    try:
        await state.engine.check_health()  # marks the engine dead: waiting clients get EngineDeadError
    except Exception as exc:
        logger.error("the engine core is gone (%s); shutting the server down", exc)
    server.config.timeout_graceful_shutdown = min(server.config.timeout_graceful_shutdown or 0, DEAD_ENGINE_GRACE_S)
    server.should_exit = True


def _start_engine(config: Any, options: ServerOptions, phases: StartupPhases) -> EngineClient:
    import sys

    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.metrics.stats import LoggingStatLogger

    prometheus = PrometheusStatLogger(
        options.served_model_names[0], config=config, num_engines=config.parallel_config.data_parallel_size
    )
    engine = AsyncLLM(config, stat_loggers=[prometheus, LoggingStatLogger()])
    for name, seconds in engine.startup.seconds.items():
        phases.add(name, seconds)
    if "torch" in sys.modules:  # the front end does no model work: leave the cores to the engine
        sys.modules["torch"].set_num_threads(1)
    return engine


def _bind_socket(host: str, port: int) -> Any:
    """Bind before loading the model, so a busy port fails fast. Not inherited by the engine."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port or --host") from None
    sock.listen(2048)
    return sock


def _install_signal_handlers(server: Any) -> None:
    """uvicorn installs its own SIGTERM/SIGINT handlers while serving (stop accepting, drain up
    to timeout_graceful_shutdown) and, once drained, re-raises the signal to the handlers it
    found. With the default handlers that re-raise would kill us (exit -15) after a clean drain;
    these make it a no-op, so the process exits 0. A signal that lands just before uvicorn's
    handlers are in place still stops the server."""
    import signal

    def stop(signum: int, frame: Any) -> None:
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def startup_breakdown(
    phases: StartupPhases, engine_phases: dict[str, float], engine_seconds: float, total: float
) -> str:
    """One line: the wall-clock ``total``, the front end's phases in order, the engine process's
    own inside its phase (what the engine did not account for is the process start and its imports)."""
    front = dict(phases.seconds)
    parts = []
    for name, seconds in front.items():
        if name == "engine process":
            inner = {"start and imports": max(seconds - engine_seconds, 0.0), **engine_phases}
            parts.append(f"engine process {seconds:.2f} s [{', '.join(f'{k} {v:.2f} s' for k, v in inner.items())}]")
        elif name == "tokenizer":
            parts.append(f"tokenizer {seconds:.2f} s (meanwhile)")
        else:
            parts.append(f"{name} {seconds:.2f} s")
    return f"start-up {total:.1f} s: {', '.join(parts)}"


def _print_startup(
    engine: EngineClient, options: ServerOptions, args: argparse.Namespace, phases: StartupPhases, started: float
) -> None:
    mc = engine.config.model_config
    cap = engine.capacity
    host = "localhost" if args.host in ("0.0.0.0", "::", "") else args.host
    host = f"[{host}]" if ":" in host else host
    url = f"http://{host}:{args.port}"
    lines = [
        f"pagedllm {pagedllm.__version__}: loaded {mc.model} ({mc.arch.architecture}, {mc.dtype}, "
        f"max_model_len={mc.max_model_len}) on {engine.config.device}",
        f"capacity: {cap.get('summary', '?')} (engine ready in {cap.get('startup_seconds', 0):.1f} s)",
        startup_breakdown(
            phases, cap.get("startup_phases", {}), cap.get("startup_seconds", 0.0), time.perf_counter() - started
        ),
        f"serving model name(s): {', '.join(options.served_model_names)}; API key "
        f"{'required' if options.api_keys else 'not required'}; metrics prefix vllm: at /metrics",
        f"listening on {url} (bound to {args.host}); OpenAI base URL: {url}/v1",
    ]
    if options.api_keys:
        lines.insert(-1, describe_keys(options.api_keys, engine.config.scheduler_config.policy))
    print("\n".join(lines), flush=True)


def _startup_error(exc: BaseException) -> None:
    import sys

    print(f"error: {exc}", file=sys.stderr, flush=True)


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
