"""Environment variables are read in one module (``pagedllm/envs.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedllm import envs

PACKAGE = Path(envs.__file__).parent


def test_only_envs_reads_the_environment() -> None:
    readers = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "envs.py" and re.search(r"os\.environ|os\.getenv", p.read_text())
    ]
    assert readers == [], f"read environment variables through pagedllm.envs instead: {readers}"


def test_every_variable_read_is_declared() -> None:
    used = set()
    for p in PACKAGE.rglob("*.py"):
        used |= set(re.findall(r"\"((?:PAGEDLLM|TRITON)_[A-Z_]+)\"", p.read_text()))
    assert used <= set(envs.ENV_VARS), used - set(envs.ENV_VARS)


def test_switches_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_CPU_GEMM", raising=False)
    assert envs.enabled("PAGEDLLM_CPU_GEMM")
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM", "0")
    assert not envs.enabled("PAGEDLLM_CPU_GEMM")
    monkeypatch.setenv("PAGEDLLM_DEVICE", "cuda")
    assert envs.device_override() == "cuda"
    monkeypatch.setenv("PAGEDLLM_DEVICE", "tpu")
    with pytest.raises(ValueError, match="PAGEDLLM_DEVICE must be cpu or cuda"):
        envs.device_override()
    monkeypatch.setenv("PAGEDLLM_CACHE", "/tmp/x")
    assert envs.cache_dir() == Path("/tmp/x")
