"""The CPU kernel build cache: keyed by sources, flags and torch; a finished build loads directly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pagedllm.layers import cpu_kernels


def test_build_location_changes_with_sources_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = tmp_path / "a.cpp"
    source.write_text("int a;")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (source,))
    first = cpu_kernels.build_location("portable")
    assert first.directory.parent == tmp_path and first.name.startswith("pagedllm_portable_")
    assert cpu_kernels.build_location("portable") == first
    source.write_text("int b;")
    second = cpu_kernels.build_location("portable")
    assert second != first
    monkeypatch.setattr(cpu_kernels, "compile_flags", lambda level: ["-O0"])
    assert cpu_kernels.build_location("portable") != second
    assert cpu_kernels.needs_build("portable") and not second.is_built()


def test_a_finished_build_loads_without_cpp_extension():
    """A fresh process loads the cached build with torch.ops.load_library: no ninja check."""
    level = cpu_kernels.selected_isa()
    if not cpu_kernels.build_cpu_library(level):
        pytest.skip("the C++ kernels could not be built here")
    assert cpu_kernels.build_location(level).is_built() and not cpu_kernels.needs_build(level)
    script = textwrap.dedent(f"""
        import sys, torch
        from pagedllm.layers import cpu_kernels
        assert cpu_kernels.start_background_build({level!r}) is None
        assert cpu_kernels.cpu_ops({level!r}) is not None
        print("cpp_extension" if "torch.utils.cpp_extension" in sys.modules else "direct")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "direct"


def test_a_missing_build_compiles_in_the_background(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(cpu_kernels, "needs_build", lambda level=None: True)
    monkeypatch.setattr(cpu_kernels, "build_cpu_library", lambda level: calls.append(level) or True)
    thread = cpu_kernels.start_background_build("portable")
    assert thread is not None
    thread.join(10)
    assert calls == ["portable"]
    monkeypatch.setattr(cpu_kernels, "needs_build", lambda level=None: False)
    assert cpu_kernels.start_background_build("portable") is None
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    assert cpu_kernels.start_background_build() is None


def test_a_killed_builds_lock_is_removed_a_live_ones_kept(monkeypatch, tmp_path, caplog):
    """torch waits forever on its lock file; one left by a build killed long ago must not hang us."""
    import os
    import time

    import torch.utils.cpp_extension

    source = tmp_path / "a.cpp"
    source.write_text("int a;")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "SOURCES", (source,))
    where = cpu_kernels.build_location("portable")
    where.directory.mkdir(parents=True)
    lock = where.directory / "lock"
    seen: list[bool] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: seen.append(lock.exists()))
    lock.touch()
    old = time.time() - cpu_kernels.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    cpu_kernels._load_or_build(where, "portable")
    assert seen == [False] and "did not finish" in caplog.text
    lock.touch()  # a build in progress right now: torch's own wait applies
    cpu_kernels._load_or_build(where, "portable")
    assert seen == [False, True]
