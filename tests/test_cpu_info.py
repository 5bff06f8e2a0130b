"""What the CPU runs (``pagedllm/cpu_info.py``) and the kernel build flags chosen from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import cpu_info

V3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
V4 = V3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}


def fake_cpu(monkeypatch: pytest.MonkeyPatch, arch: str, flags: set[str]) -> None:
    monkeypatch.setattr(cpu_info, "machine", lambda: arch)
    monkeypatch.setattr(cpu_info, "cpu_features", lambda: frozenset(flags))


@pytest.mark.parametrize(
    "arch,flags,levels",
    [
        ("x86_64", V4 | {"avx512_vnni"}, ("avx512", "avx2", "portable")),
        ("x86_64", V3, ("avx2", "portable")),
        ("x86_64", V4 - {"avx512bw"}, ("avx2", "portable")),  # AVX-512F alone is not x86-64-v4
        ("x86_64", V3 - {"fma"}, ("portable",)),
        ("aarch64", {"asimd", "asimddp"}, ("neon", "portable")),
        ("riscv64", set(), ("portable",)),
    ],
)
def test_runnable_levels(monkeypatch, arch, flags, levels):
    fake_cpu(monkeypatch, arch, flags)
    assert cpu_info.runnable_isas() == levels
    assert cpu_info.best_isa() == levels[0]
    assert cpu_info.resolve_isa("native") == levels[0]


def test_resolve_rejects_unknown_and_unrunnable_levels(monkeypatch):
    fake_cpu(monkeypatch, "x86_64", V3)
    assert cpu_info.resolve_isa("avx2") == "avx2"
    with pytest.raises(ValueError, match="must be native or one of avx512, avx2, neon, portable"):
        cpu_info.resolve_isa("sse4")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ISA=avx512 cannot run on this CPU"):
        cpu_info.resolve_isa("avx512")


def test_dot_extension_names_the_build(monkeypatch):
    fake_cpu(monkeypatch, "x86_64", V4 | {"avx512_vnni"})
    assert cpu_info.build_name("avx512") == "avx512+vnni"
    assert cpu_info.build_name("avx2") == "avx2"  # no AVX-VNNI flag
    fake_cpu(monkeypatch, "aarch64", {"asimddp"})
    assert cpu_info.build_name("neon") == "neon+dotprod"


@pytest.mark.parametrize("permitted", [True, False])
def test_amx_names_the_build_where_the_os_permits_it(monkeypatch, permitted):
    monkeypatch.setattr(cpu_info, "_amx_permission", lambda: permitted)
    fake_cpu(monkeypatch, "x86_64", V4 | {"avx512_vnni", "amx_tile", "amx_int8"})
    assert cpu_info.build_name("avx512") == ("avx512+vnni+amx" if permitted else "avx512+vnni")
    assert cpu_info.build_name("avx2") == "avx2"  # the AMX path is the avx512 build's
    fake_cpu(monkeypatch, "x86_64", V4 | {"amx_tile", "amx_int8"})  # AMX without VNNI: no amx path
    assert cpu_info.build_name("avx512") == "avx512"


@pytest.mark.parametrize(
    "flags,bf16,fp16",
    [(V4 | {"avx512_bf16"}, True, False), (V4 | {"avx512_fp16", "amx_bf16"}, True, True), (V3, False, False)],
)
def test_native_16_bit_by_name_or_torch_dtype(monkeypatch, flags, bf16, fp16):
    fake_cpu(monkeypatch, "x86_64", flags)
    assert cpu_info.native_16_bit("bfloat16") is bf16 and cpu_info.native_16_bit("float16") is fp16
    torch = pytest.importorskip("torch")
    assert cpu_info.native_16_bit(torch.bfloat16) is bf16 and cpu_info.native_16_bit(torch.float16) is fp16


def test_compile_flags_follow_the_level_and_extension(monkeypatch):
    cpu_kernels = pytest.importorskip("pagedllm.layers.cpu_kernels")
    fake_cpu(monkeypatch, "x86_64", V4 | {"avx512_vnni", "avx_vnni"})
    avx512 = cpu_kernels.compile_flags("avx512")
    assert "-march=x86-64-v4" in avx512 and "-mavx512vnni" in avx512 and "-DPAGEDLLM_OPS=pagedllm_avx512" in avx512
    assert "-march=x86-64-v3" in cpu_kernels.compile_flags("avx2") and "-mavxvnni" in cpu_kernels.compile_flags("avx2")
    assert not any(f.startswith("-march") for f in cpu_kernels.compile_flags("portable"))
    neon = cpu_kernels.compile_flags("neon", dot=True)
    assert [f for f in neon if f.startswith("-march")] == ["-march=armv8.2-a+dotprod"]


@pytest.mark.parametrize(
    "files,quota",
    [
        ({"cpu.max": "200000 100000\n"}, 2),
        ({"cpu.max": "150000 100000\n"}, 1),  # 1.5 CPUs: whole ones only
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_cgroup_quota(tmp_path: Path, files: dict[str, str], quota: int | None):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_info._cgroup_cpu_quota(tmp_path) == quota
