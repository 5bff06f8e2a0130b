"""KVTier: the swap tier's stores and copies, on the CPU (a memory-mapped temp file)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.worker.kv_tier import KVTier


def caches() -> list[torch.Tensor]:
    """Two models' worth of layers: shapes and dtypes differ, as a draft model's may."""
    torch.manual_seed(0)
    return [torch.randn(2, 5, 16, 2, 8), torch.randn(2, 5, 16, 1, 4).to(torch.bfloat16)]


def test_swap_out_then_in_restores_every_cache_tensor() -> None:
    kv = caches()
    tier = KVTier(kv, num_slots=3)
    assert [s.shape[1] for s in tier.stores] == [3, 3] and [s.dtype for s in tier.stores] == [kv[0].dtype, kv[1].dtype]
    saved = [c[:, [2, 4]].clone() for c in kv]
    tier.copy([(2, 1), (4, 0)], [])
    for c in kv:
        c[:, [2, 4]] = 0
    tier.copy([], [(3, 1), (1, 0)])  # restored into other blocks
    for c, s in zip(kv, saved, strict=True):
        assert torch.equal(c[:, 3], s[:, 0]) and torch.equal(c[:, 1], s[:, 1])


def test_swap_outs_run_before_swap_ins_in_one_step() -> None:
    """Block 1 is evicted to slot 0 and, in the same step, receives slot 1 (saved earlier)."""
    kv = caches()
    tier = KVTier(kv, num_slots=2)
    block2 = [c[:, 2].clone() for c in kv]
    block1 = [c[:, 1].clone() for c in kv]
    tier.copy([(2, 1)], [])
    tier.copy([(1, 0)], [(1, 1)])
    for c, two in zip(kv, block2, strict=True):
        assert torch.equal(c[:, 1], two)
    tier.copy([], [(3, 0)])
    for c, one in zip(kv, block1, strict=True):
        assert torch.equal(c[:, 3], one)


def test_no_slots_no_store() -> None:
    tier = KVTier(caches(), num_slots=0)
    assert tier.stores == []
    tier.copy([], [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the tier is pinned host memory there")
def test_cuda_caches_swap_through_pinned_host_memory() -> None:
    kv = [c.cuda() for c in caches()]
    tier = KVTier(kv, num_slots=2)
    assert all(s.device.type == "cpu" and s.is_pinned() for s in tier.stores)
    saved = [c[:, 4].clone() for c in kv]
    tier.copy([(4, 1)], [])
    tier.copy([], [(2, 1)])
    torch.cuda.synchronize()
    for c, s in zip(kv, saved, strict=True):
        assert torch.equal(c[:, 2], s)
