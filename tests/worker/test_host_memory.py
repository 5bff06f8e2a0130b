"""The CPU worker keeps freed host memory mapped (glibc): opt-outs, and the effect on page faults."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from pagedllm.worker import host_memory

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's allocator only"
)

# Three 8 MiB blocks touched and freed, over and over: the minor page faults per round once
# steady. With glibc's defaults the heap top is handed back on every free (more than the trim
# threshold of twice the largest block freed so far), so every round faults its 6,144 pages again.
_ROUNDS = """
import ctypes, resource, sys
from pagedllm.worker.host_memory import keep_freed_memory
print(keep_freed_memory())
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def round_():
    blocks = [libc.malloc(8 << 20) for _ in range(3)]
    for b in blocks:
        libc.memset(b, 1, 8 << 20)
    for b in blocks:
        libc.free(b)
for _ in range(5):
    round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    round_()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def _faults_per_round(keep: str) -> tuple[bool, float]:
    env = {"PAGEDLLM_KEEP_FREED_MEMORY": keep, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _ROUNDS], env=env, capture_output=True, text=True, check=True)
    kept, faults = out.stdout.split()
    return kept == "True", float(faults)


@glibc
def test_freed_blocks_are_reused_without_page_faults():
    kept, faults = _faults_per_round("1")
    off, default_faults = _faults_per_round("0")
    assert kept and not off
    assert default_faults > 5000  # glibc's default: the 24 MiB fault in again every round
    assert faults < 100


def test_turned_off_or_left_to_the_users_glibc_tunables(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_KEEP_FREED_MEMORY", "0")
    assert host_memory.keep_freed_memory() is False
    monkeypatch.setenv("PAGEDLLM_KEEP_FREED_MEMORY", "1")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")
    assert host_memory.keep_freed_memory() is False
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert host_memory.keep_freed_memory() is False
