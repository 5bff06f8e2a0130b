"""The CPU KV cache is zero-filled pages the OS provides on first touch (no start-up memset)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm.worker.kv_layers import zeroed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeroed_cache_reads_zero_until_written(dtype):
    cache = zeroed((2, 64, 16, 2, 8), dtype, torch.device("cpu"))
    assert cache.shape == (2, 64, 16, 2, 8) and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.isnan().any() and cache.count_nonzero() == 0
    cache[0, 3, 5] = 2.0
    assert cache.sum().item() == 2.0 * 16 and cache[1].count_nonzero() == 0


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident size from /proc")
def test_zeroed_cache_is_not_committed_up_front():
    """A 1 GiB pool takes memory only where it is written (torch.zeros writes all of it)."""
    before = _rss_bytes()
    cache = zeroed((2, 1 << 14, 16, 8, 64), torch.float32, torch.device("cpu"))
    assert cache.numel() * 4 == 1 << 30
    cache[0, :16] = 1.0  # 16 blocks: 512 KiB
    assert _rss_bytes() - before < 64 << 20
    assert cache[:, -1].count_nonzero() == 0
