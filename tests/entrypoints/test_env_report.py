"""``pagedllm env`` (what a bug report needs) and ``pagedllm build-kernels``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

import pagedllm
from pagedllm import cpu_info
from pagedllm.entrypoints import env_report
from pagedllm.entrypoints.cli import main
from pagedllm.layers import cpu_kernels


def _env_json(capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    assert main(["env", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_env_json_reports_versions_cpu_and_settings(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM", "0")
    report = _env_json(capsys, "--no-build")
    assert report["pagedllm"]["version"] == pagedllm.__version__
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert report["cpu"]["model"] == cpu_info.cpu_model()
    assert report["cpu"]["usable_cores"] == cpu_info.usable_cpus()
    assert report["kernels"]["runnable_levels"] == [cpu_info.build_name(lv) for lv in cpu_info.runnable_isas()]
    assert report["kernels"]["selected"] == cpu_info.best_isa()
    assert report["kernels"]["build"].startswith("not built yet")
    assert report["kernels"]["cache"] == str(tmp_path)
    assert not any(tmp_path.iterdir()), "--no-build compiled something"
    assert report["env"]["PAGEDLLM_CPU_GEMM"] == "0"
    assert report["gpu"]["cuda_available"] == torch.cuda.is_available()


def test_env_names_a_bad_isa_instead_of_failing(capsys, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "sse9")
    kernels = _env_json(capsys, "--no-build")["kernels"]
    assert kernels["selected"] is None and "PAGEDLLM_CPU_ISA must be native or one of" in kernels["build"]


def test_env_reports_the_build_in_use(capsys):
    if not cpu_kernels.build_cpu_library(cpu_kernels.selected_isa()):
        pytest.skip("the C++ kernels could not be built here")
    kernels = _env_json(capsys)["kernels"]
    assert kernels["build"] == cpu_info.build_name(cpu_kernels.selected_isa())
    assert Path(kernels["library"]).is_file()


def test_env_text_has_every_section(capsys, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "portable")
    assert main(["env", "--no-build"]) == 0
    text = capsys.readouterr().out
    for line in (
        "pagedllm:",
        "python: ",
        "platform: ",
        "  cpu_capability: ",
        "  usable_cores_why: ",
        "  selected: portable",
    ):
        assert line in text, line
    assert "  PAGEDLLM_CPU_ISA: portable" in text


def test_git_commit_of_a_checkout():
    root = Path(pagedllm.__file__).resolve().parents[1]
    commit = env_report.git_commit()
    if not (root / ".git").exists():
        assert commit is None
        return
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert commit is not None and commit.split("+")[0] == head


def test_build_kernels_builds_the_selected_or_every_level(capsys, monkeypatch):
    built: list[str] = []
    monkeypatch.setattr(cpu_kernels, "build_cpu_library", lambda level: built.append(level) or level != "portable")
    monkeypatch.delenv("PAGEDLLM_CPU_ISA", raising=False)
    assert main(["build-kernels"]) == (1 if cpu_info.best_isa() == "portable" else 0)
    assert built == [cpu_info.best_isa()]
    built.clear()
    assert main(["build-kernels", "--all"]) == 1  # the portable "build" failed above
    assert built == list(cpu_info.runnable_isas())
    assert "FAILED" in capsys.readouterr().out


def test_build_kernels_refuses_when_kernels_are_off(monkeypatch, capsys):
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    assert main(["build-kernels"]) == 2
    assert "PAGEDLLM_CPU_KERNELS=0 turns the CPU kernels off" in capsys.readouterr().err
