"""The start-up breakdown line of ``pagedllm serve``."""

from __future__ import annotations

from pagedllm.entrypoints.openai.server_process import startup_breakdown
from pagedllm.metrics.startup import StartupPhases


def test_breakdown_nests_the_engine_phases_and_marks_the_overlapped_tokenizer():
    phases = StartupPhases()
    phases.add("imports", 0.5)
    phases.add("model and config", 1.0)
    phases.add("tokenizer", 2.0)  # loaded while the engine process starts
    phases.add("engine process", 3.0)
    phases.add("app", 0.25)
    line = startup_breakdown(phases, {"kernels": 0.01, "weights": 0.5}, engine_seconds=2.0, total=4.8)
    assert line == (
        "start-up 4.8 s: imports 0.50 s, model and config 1.00 s, tokenizer 2.00 s (meanwhile), "
        "engine process 3.00 s [start and imports 1.00 s, kernels 0.01 s, weights 0.50 s], app 0.25 s"
    )


def test_phases_accumulate_in_order():
    phases = StartupPhases()
    with phases.phase("a"):
        pass
    phases.add("b", 1.0)
    phases.add("a", 2.0)
    assert list(phases.seconds) == ["a", "b"] and phases.seconds["a"] >= 2.0
    assert phases.summary().startswith("a 2.")
