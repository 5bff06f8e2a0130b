"""benchmarks/stream_overlap.cpp builds over cpu_vec.h for every ISA level this CPU runs and
reads what it is asked to (a tiny buffer: a build and a check, not a measurement)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from benchmarks.stream_overlap import build
from pagedllm import cpu_info

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


@pytest.mark.parametrize("level", cpu_info.runnable_isas())
def test_loop_builds_and_reports_every_combination(level, tmp_path):
    binary = build(level, tmp_path)
    out = subprocess.run([str(binary), "4", "2", "0,1", "1,4", "0,16"], check=True, capture_output=True, text=True)
    lines = [line.split() for line in out.stdout.splitlines()]
    arithmetic = [words for words in lines if words[0] == "arithmetic"]
    memory = [words for words in lines if words[0] == "memory"]
    assert [words[1] for words in arithmetic] == ["W=0", "W=1"]
    assert [tuple(words[1:4]) for words in memory] == [
        (f"W={w}", f"S={s}", f"D={d}") for w in (0, 1) for s in (1, 4) for d in (0, 16)
    ]
    assert all(float(words[-1]) > 0 for words in arithmetic + memory)
    # the loop ran: its accumulators (ones times 0.5, summed) are positive
    assert "checksum" in out.stderr and float(out.stderr.split()[-1]) > 0


def test_usage_error_names_the_arguments(tmp_path):
    binary = build(cpu_info.runnable_isas()[0], tmp_path)
    out = subprocess.run([str(binary), "4"], capture_output=True, text=True)
    assert out.returncode == 2 and "MIB THREADS" in out.stderr
