"""The engine's intra-op threads follow the usable cores (affinity, cgroup quota) or OMP_NUM_THREADS."""

from __future__ import annotations

import pytest
import torch

from pagedllm import cpu_info
from pagedllm.worker import threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_follow_the_usable_cores(monkeypatch, restore_threads, caplog):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    target = 1 if torch.get_num_threads() != 1 else 2
    monkeypatch.setattr(cpu_info, "usable_cpus", lambda: target)
    with caplog.at_level("INFO", logger="pagedllm.worker.threads"):
        assert threads.set_intra_op_threads() == target
    assert torch.get_num_threads() == target
    assert f"intra-op threads: {target} (" in caplog.text


def test_omp_num_threads_is_left_to_torch(monkeypatch, restore_threads, caplog):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setattr(cpu_info, "usable_cpus", lambda: before + 5)
    with caplog.at_level("INFO", logger="pagedllm.worker.threads"):
        assert threads.set_intra_op_threads() == before
    assert torch.get_num_threads() == before
    assert "(OMP_NUM_THREADS=7)" in caplog.text


@pytest.mark.parametrize(
    ("affinity", "quota", "usable", "why"),
    [
        (8, None, 8, "CPU affinity: 8 of 16 cores"),
        (8, 2, 2, "cgroup CPU quota: 2 (affinity 8 of 16 cores)"),
        (4, 6, 4, "CPU affinity: 4 of 16 cores, cgroup quota 6"),
    ],
)
def test_core_budget_says_why(monkeypatch, affinity, quota, usable, why):
    monkeypatch.setattr(cpu_info.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(cpu_info.os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False)
    monkeypatch.setattr(cpu_info, "_cgroup_cpu_quota", lambda: quota)
    assert cpu_info.core_budget() == (usable, why)
    assert cpu_info.usable_cpus() == usable
