"""The shared-memory all-reduce (its C++ protocol, ``csrc/cpu_shm_allreduce.cpp``) gives gloo's
sums, bit for bit, through many alternating slots; sums in rank order at three ranks; raises
naming the rank that never publishes."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pagedllm.distributed import shm_allreduce
from pagedllm.layers.cpu_kernels import cpu_ops

pytestmark = pytest.mark.skipif(
    not shm_allreduce.supported() or cpu_ops() is None, reason="x86-64 with the CPU kernels built only"
)


def _init(rank: int, world_size: int, init_file: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )


def _spawn(worker, world_size: int, tmp_path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(world_size, str(tmp_path)), nprocs=world_size, start_method="spawn")


def _worker(rank: int, world_size: int, tmp: str) -> None:
    _init(rank, world_size, f"{tmp}/init")
    out_file = f"{tmp}/mismatches.pt"
    try:
        shm = shm_allreduce.ShmAllReduce(rank, world_size, slot_bytes=4096)
        assert shm.fits(torch.zeros(3)) and not shm.fits(torch.zeros(3, dtype=torch.int64))  # ints: gloo
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
    _spawn(_worker, 2, tmp_path)
    assert torch.load(tmp_path / "mismatches.pt") == 0


def _rank_order_worker(rank: int, world_size: int, tmp: str) -> None:
    """Each rank knows every rank's input (seeded by rank), so it checks the sum's exact order."""
    _init(rank, world_size, f"{tmp}/init")
    try:
        shm = shm_allreduce.ShmAllReduce(rank, world_size, slot_bytes=1 << 16)
        wrong = 0
        for i in range(50):
            gen = torch.Generator().manual_seed(i)
            big = torch.randn(64, generator=gen) * 1e6
            # b and c nearly cancel: (a + b) + c loses a's low bits, a + (b + c) keeps them.
            inputs = [torch.randn(64, generator=gen) * 1e-3, big, -big + torch.randn(64, generator=gen)]
            expected = (inputs[0] + inputs[1]) + inputs[2]
            assert not torch.equal(expected, inputs[0] + (inputs[1] + inputs[2]))  # the order shows
            x = inputs[rank].clone()
            shm.all_reduce(x)
            wrong += int(not torch.equal(x, expected))
        stats = shm.stats()  # the one counter, advanced by the C++ op, and the bytes it carried
        assert stats["ops"] == 50 and stats["bytes_reduced"] == 50 * 64 * 4 and stats["ns"] > 0
        torch.save(wrong, f"{tmp}/wrong{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_three_ranks_sum_in_rank_order(tmp_path):
    _spawn(_rank_order_worker, 3, tmp_path)
    assert [torch.load(tmp_path / f"wrong{r}.pt") for r in range(3)] == [0, 0, 0]


def _silent_peer_worker(rank: int, world_size: int, tmp: str) -> None:
    """Rank 1 joins the segment but never all-reduces: rank 0's wait must time out naming it."""
    _init(rank, world_size, f"{tmp}/init")
    try:
        shm = shm_allreduce.ShmAllReduce(rank, world_size, slot_bytes=4096, timeout_s=0.5)
        if rank == 0:
            try:
                shm.all_reduce(torch.ones(4))
                message = "no error"
            except RuntimeError as e:
                message = str(e)
            (Path(tmp) / "error.txt").write_text(message)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_peer_that_never_publishes_times_out_naming_it(tmp_path):
    _spawn(_silent_peer_worker, 2, tmp_path)
    assert "rank 1 did not publish op 1 within 0.5 s" in (tmp_path / "error.txt").read_text()
