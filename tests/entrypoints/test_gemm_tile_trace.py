"""benchmarks/gemm_tile_trace.py's build of the fp32 GEMM with PAGEDLLM_TILE_TRACE compiles, gives
F.linear's result and counts every row tile of every panel group (a build and a check, not a
measurement; x86-64 only, as the trace reads the time-stamp counter)."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from benchmarks.gemm_tile_trace import trace_mode
from benchmarks.kernel_revision import build_at_revision
from pagedllm import cpu_info
from pagedllm.layers.cpu_gemm_kernels import pack_weight

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the trace reads the x86 time-stamp counter")


def test_traced_gemm_is_the_gemm_and_counts_each_row_tile():
    level = "avx2" if "avx2" in cpu_info.runnable_isas() else cpu_info.runnable_isas()[-1]
    ops = build_at_revision(None, "cpu_gemm.cpp", level, defines=("PAGEDLLM_TILE_TRACE",))
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(128, 96, generator=gen), torch.randn(13, 96, generator=gen)  # 2 groups, 3 row tiles
    ops.tile_trace(x)
    torch.testing.assert_close(ops.packed_linear(x, pack_weight(w), None), F.linear(x, w), rtol=1e-4, atol=1e-4)
    cycles, calls = ops.tile_trace(x)
    assert calls[:, :3].sum().item() == 2 * 3 and calls[:, 3:].sum().item() == 0  # each group's 3 row tiles
    assert calls[0, :3].sum().item() >= 3 and (cycles[calls > 0] > 0).all()  # a thread's first group, timed
    assert ops.tile_trace(x)[1].sum().item() == 0  # a read zeroes the counters
    report = trace_mode(ops, x, [pack_weight(w)] * 2, reps=1)
    assert len(report["first_group_kcycles"]) == 3 and report["us_per_call"] > 0
