"""Timers around an ``LLMEngine``'s pieces, for benchmarks only: nothing in the package's hot path
changes. The engine core's ``step`` and the model runner's model are wrapped on the *instance*, so
the engine-overhead share (time in a step outside the model's forward and LM head) is measured on
the real code path."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class Stopwatch:
    """Accumulates the wall time of the calls it wraps."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._sync = sync

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
                if self._sync is not None:
                    self._sync()
                return result
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


class TimedModel:
    """Stands in for the runner's model: times ``__call__`` (the forward) and ``compute_logits``,
    delegates everything else."""

    def __init__(self, model: Any, watch: Stopwatch) -> None:
        self._model = model
        self._forward = watch.wrap(model.__call__)
        self.compute_logits = watch.wrap(model.compute_logits)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def model_runner(engine: Any) -> Any:
    """The in-process model runner behind an ``LLMEngine`` (a clear error if the layout changed)."""
    try:
        return engine.engine_core.executor.worker.model_runner
    except AttributeError as exc:
        raise RuntimeError(
            "bench latency expects LLMEngine.engine_core.executor.worker.model_runner; "
            f"the engine layout changed ({exc}): update pagedllm/entrypoints/bench/engine_probe.py"
        ) from exc


class EngineProbe:
    """``core`` times ``EngineCore.step``; ``model`` times forward + LM head inside it."""

    def __init__(self, engine: Any, device: str) -> None:
        import torch

        sync = torch.cuda.synchronize if device == "cuda" else None
        self.core = Stopwatch(sync)
        self.model = Stopwatch(sync)
        engine.engine_core.step = self.core.wrap(engine.engine_core.step)
        runner = model_runner(engine)
        runner.model = TimedModel(runner.model, self.model)
        self.weights_model = runner.model._model

    def reset(self) -> None:
        self.core.reset()
        self.model.reset()
