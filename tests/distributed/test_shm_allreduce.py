"""The shared-memory all-reduce gives gloo's sums, bit for bit, through many alternating slots."""

from __future__ import annotations

import datetime

import pytest
import torch

from pagedllm.distributed import shm_allreduce

pytestmark = pytest.mark.skipif(not shm_allreduce.supported(), reason="x86-64 only")


def _worker(rank: int, world_size: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        shm = shm_allreduce.ShmAllReduce(rank, world_size, slot_bytes=4096)
        gen = torch.Generator().manual_seed(rank)
        mismatches = 0
        for i in range(200):
            dtype = (torch.float32, torch.bfloat16)[i % 2]
            x = torch.randn(1 + i % 37, 7, generator=gen).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            assert shm.fits(x)
            got = shm.all_reduce(x)
            mismatches += int(got is not x or not torch.equal(got, expected))
            part = torch.randn(3, 1 + i % 5, generator=gen).to(dtype)
            gathered = [torch.empty_like(part) for _ in range(world_size)]
            dist.all_gather(gathered, part)
            mismatches += int(not torch.equal(shm.all_gather(part, dim=-1), torch.cat(gathered, dim=-1)))
        assert not shm.fits(torch.zeros(2048))  # larger than a slot: the caller uses gloo
        if rank == 0:
            torch.save(mismatches, out_file)
    finally:
        dist.destroy_process_group()


def test_matches_gloo(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "mismatches.pt"
    mp.start_processes(_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, start_method="spawn")
    assert torch.load(out) == 0
