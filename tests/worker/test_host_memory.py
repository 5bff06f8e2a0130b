"""The CPU worker keeps freed host memory mapped (glibc): opt-outs, and the effect on page faults."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


# ---- huge pages ----
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) and smaps are Linux's")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (smaps)."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            mapping = lo <= address < hi
        elif mapping and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1024, 512)  # 2 MiB: the arena is over one huge page
        self.head = torch.nn.Linear(512, 1024, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage
        self.norm = torch.nn.Parameter(torch.randn(512, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("packed", torch.randint(0, 255, (3, 40, 8), dtype=torch.uint8))
        self.register_buffer("tail", self.packed[1:])  # a view of another buffer: stays a view


@linux
def test_weights_move_into_one_huge_page_mapping_unchanged(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "1")
    torch.manual_seed(0)
    model = _Tied().requires_grad_(False)
    tensors = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]}
    before = {
        name: (t.clone(), t.dtype, t.shape, t.stride(), t.untyped_storage().data_ptr()) for name, t in tensors.items()
    }
    ids = {name: id(t) for name, t in tensors.items()}
    moved = host_memory.weights_to_huge_pages(model)
    # Each storage once, 64-byte aligned: the embedding (tied), the norm, the packed buffer (its view shares it).
    assert moved == 1024 * 512 * 4 + 1024 + 960
    after = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]}
    arena = {t.untyped_storage().data_ptr() for t in after.values()}
    assert len(arena) == 1 and next(iter(arena)) not in {b[4] for b in before.values()}
    for name, t in after.items():
        value, dtype, shape, stride, _ = before[name]
        assert id(t) == ids[name] and t.dtype == dtype and t.shape == shape and t.stride() == stride
        assert torch.equal(t, value), name
    assert model.head.weight is model.embed.weight
    assert model.tail.data_ptr() == model.packed[1:].data_ptr()
    model.packed[1, 0, 0] = 7  # still a view of the packed buffer
    assert model.tail[0, 0, 0] == 7
    assert "hg" in _vm_flags(model.embed.weight.data_ptr())  # the mapping asked for huge pages
    assert torch.equal(model.head(torch.ones(2, 512)), torch.ones(2, 512) @ before["embed.weight"][0].T)


@linux
def test_huge_pages_turned_off_or_too_small(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "0")
    model = _Tied()
    address = model.embed.weight.data_ptr()
    assert host_memory.weights_to_huge_pages(model) == 0 and model.embed.weight.data_ptr() == address
    assert "hg" not in _vm_flags(host_memory.anonymous_pages(4 << 20).data_ptr())
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "1")
    small = torch.nn.Linear(64, 64)
    address = small.weight.data_ptr()
    assert host_memory.weights_to_huge_pages(small) == 0 and small.weight.data_ptr() == address
    pages = host_memory.anonymous_pages(4 << 20)
    assert pages.numel() == 4 << 20 and not pages.any() and "hg" in _vm_flags(pages.data_ptr())


# ---- KVPrefaulter ----
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise / mincore: Linux only")


def _resident_blocks(cache: torch.Tensor, num_blocks: int) -> list[bool]:
    """Per block: every page under it in both planes is resident (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = host_memory.PAGE
    nbytes = cache.numel() * cache.element_size()
    pages = -(-nbytes // page)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(cache.data_ptr(), pages * page, vec) == 0
    resident = [b & 1 for b in vec.raw]
    block_bytes = nbytes // 2 // num_blocks
    out = []
    for b in range(num_blocks):
        ok = True
        for plane in (0, 1):
            first = (plane * nbytes // 2 + b * block_bytes) // page
            last = (plane * nbytes // 2 + (b + 1) * block_bytes - 1) // page
            ok &= all(resident[first : last + 1])
        out.append(bool(ok))
    return out


def _wait_for(predicate, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _cache(num_blocks: int, block_bytes: int) -> torch.Tensor:
    """A [2, num_blocks, block_bytes / 4] float32 cache in fresh 4 KiB pages, as kv_layers makes them."""
    return (
        host_memory.anonymous_pages(2 * num_blocks * block_bytes, huge=False)
        .view(torch.float32)
        .view(2, num_blocks, -1)
    )


@linux
def test_prefaulter_keeps_the_blocks_ahead_of_the_newest_populated(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_KV_PREFAULT_MIB", "1")
    blocks, block_bytes = 64, 8192  # two layers of 16 KiB per block: 1 MiB ahead is 32 blocks
    caches = [_cache(blocks, block_bytes), _cache(blocks, block_bytes)]
    caches[0][0, 40] = 7.0  # a written block keeps its values when populated
    prefault = host_memory.KVPrefaulter.for_caches(caches, blocks)
    assert prefault is not None
    _wait_for(lambda: prefault.populated_blocks >= 32)
    for cache in caches:
        resident = _resident_blocks(cache, blocks)
        assert all(resident[:32]) and not any(resident[41:])  # 40 was written: resident in the K plane
    prefault.saw(10)  # the step was given blocks up to 10: populate up to 10 + 1 + 32
    _wait_for(lambda: prefault.populated_blocks >= 43)
    assert all(_resident_blocks(caches[1], blocks)[:43])
    assert torch.all(caches[0][0, 40] == 7.0) and torch.all(caches[1][:, :43] == 0)
    prefault.saw(blocks - 1)  # the whole pool: the thread stops
    _wait_for(lambda: not prefault.active)
    assert prefault.populated_blocks == blocks and all(_resident_blocks(caches[0], blocks))
    prefault.close()


@linux
def test_prefaulter_stops_when_its_caches_are_dropped_and_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_KV_PREFAULT_MIB", "1")
    caches = [_cache(1024, 8192)]
    prefault = host_memory.KVPrefaulter.for_caches(caches, 1024)
    assert prefault is not None
    _wait_for(lambda: prefault.populated_blocks >= 64)
    del caches  # held weakly: the mapping goes, and the waiting thread ends
    _wait_for(lambda: not prefault.active, timeout=5.0)
    monkeypatch.setenv("PAGEDLLM_KV_PREFAULT_MIB", "0")
    assert host_memory.KVPrefaulter.for_caches([_cache(4, 8192)], 4) is None
    monkeypatch.setenv("PAGEDLLM_KV_PREFAULT_MIB", "1")
    assert host_memory.KVPrefaulter.for_caches([_cache(4, 8192)], 8) is None  # not [2, num_blocks, ...]
