"""The kernel sources build for aarch64 (the neon level, with and without the dotprod extension)
with the real build's flags (``cpu_kernels.compile_flags``), checked with a cross compiler so an
x86 machine catches what would break the NEON backend of csrc/cpu_vec.h and the tiles over it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from pagedllm.layers import cpu_kernels

CROSS = "aarch64-linux-gnu-g++"
pytestmark = pytest.mark.skipif(
    shutil.which(CROSS) is None, reason=f"{CROSS} is not on PATH (Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu)"
)
# What torch's cpp_extension.load adds to every source (torch 2.13), before our flags.
TORCH_FLAGS = ["-std=c++20", "-fPIC"]
DOT = pytest.mark.parametrize("dot", [False, True], ids=["neon", "neon+dotprod"])


def cross(dot: bool, *args: str) -> subprocess.CompletedProcess[str]:
    includes = [f"-I{p}" for p in torch.utils.cpp_extension.include_paths()]
    flags = cpu_kernels.compile_flags("neon", dot=dot)
    return subprocess.run([CROSS, *TORCH_FLAGS, *flags, *includes, *args], capture_output=True, text=True, timeout=600)


@DOT
def test_neon_flags_pick_the_neon_backend(dot):
    # The predefined and cpu_vec.h macros after preprocessing: the NEON backend, not the generic one.
    result = cross(dot, "-E", "-dM", str(cpu_kernels.SOURCES[0].parent / "cpu_vec.h"))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "#define PAGEDLLM_VEC_NEON 1" in result.stdout
    assert ("#define __ARM_FEATURE_DOTPROD 1" in result.stdout) == dot


@DOT
@pytest.mark.parametrize("source", cpu_kernels.SOURCES, ids=lambda p: p.name)
def test_every_source_compiles_for_aarch64(source: Path, dot: bool, tmp_path: Path):
    result = cross(dot, "-c", str(source), "-o", str(tmp_path / f"{source.stem}.o"))
    assert result.returncode == 0, result.stderr[-4000:]
