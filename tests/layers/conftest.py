"""Fixtures of the CPU kernel tests: every ISA level this CPU runs, each its own build."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm import cpu_info
from pagedllm.layers import cpu_kernels


@pytest.fixture(scope="session", params=cpu_info.runnable_isas())
def isa_ops(request: pytest.FixtureRequest) -> Any:
    """``torch.ops.pagedllm_<level>`` for each level this CPU executes (an AVX-512 machine tests the
    avx512, avx2 and portable builds), so one machine covers the code paths of the others."""
    ops = cpu_kernels.cpu_ops(request.param)
    if ops is None:
        pytest.skip(f"the {request.param} kernel build failed here")
    return ops
