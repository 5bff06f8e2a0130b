"""One CPU kernel source as of a git revision (or the working tree), built beside the engine's own
build in the same process, for before / after timing on the same inputs and machine state.

    ops = build_at_revision("0a15a17", "cpu_gemm.cpp", "avx2")
    ops.packed_linear.default(x, packed, None)

The ``.cpp`` and every header of ``pagedllm/csrc`` at that revision are written to a temp folder
and compiled with the engine's flags for ``level``, with the ops registered under their own
namespace (``rev_<rev>_<source>_<level>``), so both builds' ops coexist. ``extra`` adds source
files by name and text (a registration for a kernel whose ops ``cpu_ops.cpp`` declares). The
revision must take the same packed layout as the caller's weights.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from pagedllm.layers.cpu_kernels import compile_flags

REPO = Path(__file__).resolve().parents[1]
CSRC = "pagedllm/csrc"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def build_at_revision(
    rev: str | None,
    source: str,
    level: str,
    extra: dict[str, str] | None = None,
    defines: tuple[str, ...] = (),
) -> Any:
    """``torch.ops.<namespace>`` for ``pagedllm/csrc/<source>`` as of ``rev`` (None: the working
    tree), built for ``level``, with the ``extra`` sources beside it and the preprocessor
    ``defines`` (e.g. ``PAGEDLLM_TILE_TRACE``; each gets a namespace of its own)."""
    from torch.utils.cpp_extension import load

    folder = Path(tempfile.mkdtemp(prefix="kernel-revision-"))
    if rev is None:
        texts = {p.name: p.read_text() for p in (REPO / CSRC).iterdir() if p.name == source or p.suffix == ".h"}
    else:
        names = [n for n in _git("ls-tree", "--name-only", f"{rev}:{CSRC}").split() if n == source or n.endswith(".h")]
        texts = {n: _git("show", f"{rev}:{CSRC}/{n}") for n in names}
    for name, text in {**texts, **(extra or {})}.items():
        (folder / name).write_text(text)
    namespace = re.sub(r"\W", "_", "_".join([f"rev_{rev or 'worktree'}_{Path(source).stem}_{level}", *defines]))
    flags = [f for f in compile_flags(level) if not f.startswith("-DPAGEDLLM_OPS=")] + [f"-DPAGEDLLM_OPS={namespace}"]
    flags += [f"-D{name}" for name in defines]
    load(
        namespace,
        [str(folder / name) for name in [source, *(extra or {})]],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
    )
    return getattr(torch.ops, namespace)
