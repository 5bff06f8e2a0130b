"""``pagedllm env``: what a bug report needs about this installation and machine.

Versions (pagedllm and its git commit in a checkout, Python, torch and its CPU capability,
transformers and friends), the OS, the CPU (model, cores this process may use and why), the
kernel ISA levels it runs, the selected level and the kernel build in use, a GPU if present,
and the ``PAGEDLLM_*`` variables set. Plain text, or one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pagedllm

_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "xgrammar", "triton")


def add_env_parser(sub) -> None:
    parser = sub.add_parser(
        "env",
        help="print the versions, CPU, kernel build and settings a bug report needs",
        description="Print what to paste into a bug report: versions, OS, CPU and usable cores, "
        "kernel ISA levels and the build in use, GPU, and the PAGEDLLM_* variables set.",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.add_argument(
        "--no-build",
        action="store_true",
        help="do not compile the kernel build when it is missing (only say whether it is cached)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = collect(build=not args.no_build)
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0


def collect(build: bool = True) -> dict[str, Any]:
    """The report as a JSON-able dict; ``build=False`` never compiles the kernels."""
    import torch

    from pagedllm import cpu_info, envs

    usable, why = cpu_info.core_budget()
    return {
        "pagedllm": {"version": pagedllm.__version__, "git_commit": git_commit(), "path": str(_package_root())},
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in _PACKAGES},
        "torch": {
            "version": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "intra_op_threads": torch.get_num_threads(),
        },
        "cpu": {
            "model": cpu_info.cpu_model(),
            "machine": cpu_info.machine(),
            "usable_cores": usable,
            "usable_cores_why": why,
            "OMP_NUM_THREADS": envs.omp_num_threads() or None,
        },
        "kernels": _kernels(build),
        "gpu": _gpu(torch),
        "env": envs.pagedllm_vars_set(),
    }


def _kernels(build: bool) -> dict[str, Any]:
    from pagedllm import cpu_info, envs
    from pagedllm.layers import cpu_kernels

    info: dict[str, Any] = {
        "runnable_levels": [cpu_info.build_name(level) for level in cpu_info.runnable_isas()],
        "cache": str(envs.kernel_build_root()),
    }
    try:
        level = cpu_kernels.selected_isa()
    except ValueError as exc:  # a bad PAGEDLLM_CPU_ISA is exactly what a report should show
        return {**info, "selected": None, "build": f"none: {exc}"}
    info["selected"] = level
    if not cpu_kernels.kernels_enabled():
        return {**info, "build": cpu_kernels.kernel_build()}
    where = cpu_kernels.build_location(level)
    info["library"] = str(where.library)
    if where.is_built():
        return {**info, "build": cpu_kernels.kernel_build() if build else f"{cpu_info.build_name(level)} (cached)"}
    if not build:
        return {**info, "build": "not built yet (`pagedllm build-kernels` compiles it; so does the first start)"}
    print(
        f"compiling the {cpu_info.build_name(level)} kernel build (not cached yet; about 30 s on 2 cores) ...",
        file=sys.stderr,
        flush=True,
    )
    return {**info, "build": f"{cpu_kernels.kernel_build()} (compiled now)"}


def _gpu(torch: Any) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cuda_available": False, "torch_cuda": torch.version.cuda}
    return {
        "cuda_available": True,
        "torch_cuda": torch.version.cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _package_root() -> Path:
    return Path(pagedllm.__file__).resolve().parent


def git_commit() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes to tracked files), None when
    pagedllm is not installed from a git checkout."""
    root = _package_root().parent
    if not (root / ".git").exists():
        return None
    try:
        head = _git(root, "rev-parse", "HEAD")
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


def format_text(report: dict[str, Any]) -> str:
    """``key: value`` lines, nested sections indented, in the report's order."""
    lines: list[str] = []
    for key, value in report.items():
        if isinstance(value, dict):
            lines.append(f"{key}:" + ("" if value else " (none)"))
            lines.extend(f"  {k}: {_text(v)}" for k, v in value.items())
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)
