"""One CPU kernel source as of another git revision, built beside the engine's own build in the
same process, for before / after timing on the same weights and the same machine state.

    ops = build_at_revision("0a15a17", "cpu_gemm.cpp", "avx2")
    ops.packed_linear.default(x, packed, None)

The ``.cpp`` and every header of ``pagedllm/csrc`` at that revision are written to a temp folder
and compiled with the engine's flags for ``level``, with the ops registered under their own
namespace (``rev_<rev>_<source>_<level>``), so both builds' ops coexist. The revision must take
the same packed layout as the caller's weights.
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


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def build_at_revision(rev: str, source: str, level: str) -> Any:
    """``torch.ops.<namespace>`` for ``pagedllm/csrc/<source>`` as of ``rev``, built for ``level``."""
    from torch.utils.cpp_extension import load

    folder = Path(tempfile.mkdtemp(prefix="kernel-revision-"))
    headers = [n for n in _git("ls-tree", "--name-only", f"{rev}:pagedllm/csrc").split() if n.endswith(".h")]
    for name in [source, *headers]:
        (folder / name).write_text(_git("show", f"{rev}:pagedllm/csrc/{name}"))
    namespace = re.sub(r"\W", "_", f"rev_{rev}_{Path(source).stem}_{level}")
    flags = [f for f in compile_flags(level) if not f.startswith("-DPAGEDLLM_OPS=")] + [f"-DPAGEDLLM_OPS={namespace}"]
    load(
        namespace,
        [str(folder / source)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
    )
    return getattr(torch.ops, namespace)
