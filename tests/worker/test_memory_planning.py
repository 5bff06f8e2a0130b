"""GPU memory planning, checked on CPU: the budget arithmetic, the measurement (torch.cuda's memory
queries monkeypatched), the start-up error, and the profiling forward itself (on CPU tensors)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.worker import worker as worker_mod
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.worker import (
    MemoryProfile,
    Worker,
    kv_cache_budget,
    measure_memory,
    profile_forward,
    profile_lengths,
)

GiB = 1 << 30


def test_kv_cache_budget_arithmetic():
    profile = MemoryProfile(total=80 * GiB, used_after_load=17 * GiB, activation_peak=3 * GiB)
    assert kv_cache_budget(profile, 0.9, GiB // 2) == int(72 * GiB) - 20 * GiB - GiB // 2
    assert kv_cache_budget(profile, 0.2, 0) < 0  # the model alone exceeds 20%: no room at all


class FakeCuda:
    """torch.cuda's memory queries for a device with 80 GiB, 17 GiB in use after loading
    (16 of them ours), on which the profiling forward allocates 3 GiB at its peak."""

    def __init__(self) -> None:
        self.allocated, self.peak, self.calls = 16 * GiB, 16 * GiB, []

    def install(self, monkeypatch) -> None:
        for name in (
            "empty_cache",
            "reset_peak_memory_stats",
            "mem_get_info",
            "memory_allocated",
            "max_memory_allocated",
            "synchronize",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak = self.allocated

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return 80 * GiB - (self.allocated + GiB), 80 * GiB

    def memory_allocated(self, device=None) -> int:
        return self.allocated

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def synchronize(self, device=None) -> None:
        self.calls.append("synchronize")

    def profile(self) -> None:
        self.peak = self.allocated + 3 * GiB  # activations, freed again at the end


def test_measure_memory_with_patched_queries(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    profile = measure_memory(torch.device("cuda"), fake.profile)
    assert profile == MemoryProfile(total=80 * GiB, used_after_load=17 * GiB, activation_peak=3 * GiB)
    assert fake.calls == ["empty_cache", "synchronize", "empty_cache"]


@pytest.fixture(scope="module")
def config(llama_model_dir):
    return EngineArgs(
        model=str(llama_model_dir),
        device="cpu",
        max_model_len=64,
        max_num_batched_tokens=150,
        max_num_seqs=4,
        gpu_memory_utilization=0.5,
    ).create_engine_config()


def _cuda_worker(config, monkeypatch, fake: FakeCuda) -> Worker:
    """A Worker that believes it is on CUDA, with fake memory queries and a fake profiling forward."""
    fake.install(monkeypatch)
    worker = Worker.__new__(Worker)
    worker.config, worker.device = config, torch.device("cuda")
    worker.model_runner = SimpleNamespace(attn_backend=SimpleNamespace(name="triton"))  # graphs on
    monkeypatch.setattr(worker, "_profile_run", fake.profile)
    return worker


def test_num_blocks_from_profiled_budget(config, monkeypatch):
    worker = _cuda_worker(config, monkeypatch, FakeCuda())
    budget = 40 * GiB - 17 * GiB - 3 * GiB - worker_mod._RUNTIME_RESERVE - worker_mod._CUDA_GRAPH_RESERVE
    assert worker._kv_memory_budget() == budget
    useful = config.scheduler_config.max_num_seqs * config.blocks_per_max_len_request() + 1
    assert worker.determine_num_blocks() == min(budget // config.kv_bytes_per_block(), useful)


def test_clear_error_when_one_max_length_request_does_not_fit(config, monkeypatch):
    fake = FakeCuda()
    fake.profile = lambda: setattr(
        fake, "peak", fake.allocated + 23 * GiB - worker_mod._RUNTIME_RESERVE - worker_mod._CUDA_GRAPH_RESERVE - 1000
    )  # leaves 1000 bytes
    worker = _cuda_worker(config, monkeypatch, fake)
    with pytest.raises(ValueError, match="--gpu-memory-utilization") as err:
        worker.determine_num_blocks()
    assert "--max-model-len" in str(err.value) and "smaller model" in str(err.value)


def test_profile_lengths():
    assert profile_lengths(2048, 512, 256) == [512] * 4
    assert profile_lengths(150, 64, 4) == [64, 64, 22]
    assert profile_lengths(2048, 4096, 256) == [2048]  # chunked prefill: one chunk of the budget
    assert profile_lengths(8192, 100, 3) == [100] * 3  # no step holds more than max_num_seqs requests


def test_profile_forward_runs_on_cpu(config):
    """The profiling step runs the real model, attention backend and sampler against scratch caches."""
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    with torch.inference_mode():
        profile_forward(runner, config)
    caches = [m.kv_cache for m in runner.model.modules() if hasattr(m, "bind_kv_cache")]
    assert caches and all(c.shape[1] == 1 for c in caches)  # one throwaway block per layer
    runner.initialize_kv_cache(config.blocks_per_max_len_request() + 1)  # the real pool replaces them
    assert all(m.kv_cache.shape[1] > 1 for m in runner.model.modules() if hasattr(m, "bind_kv_cache"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profiled_engine_stays_within_utilization(llama_model_dir):
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        str(llama_model_dir), device="cuda", gpu_memory_utilization=0.5, max_model_len=256, max_num_batched_tokens=4096
    )
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in range(40, 240, 8)]
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    free, total = torch.cuda.mem_get_info()
    assert total - free <= 0.5 * total
    assert llm.llm_engine.engine_core.num_blocks > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_start_up_error_names_the_fix(llama_model_dir):
    from pagedllm import LLM

    free, total = torch.cuda.mem_get_info()
    share = max((total - free) / total / 2, 1e-4)  # less than is already in use: nothing is left
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        LLM(str(llama_model_dir), device="cuda", gpu_memory_utilization=share)


def test_weight_bytes_counts_each_storage_once():
    from pagedllm.worker.worker import weight_bytes

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(100, 8)
    model.head = torch.nn.Linear(8, 100, bias=False)
    model.head.weight = model.embed.weight  # tied: one storage
    model.norm = torch.nn.LayerNorm(8)
    model.register_buffer("cache", torch.zeros(10, dtype=torch.float16))
    assert weight_bytes(model) == 100 * 8 * 4 + 2 * 8 * 4 + 10 * 2


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_weight_bytes_counts_onednn_prepacked_weights(llama_model_dir, monkeypatch):
    """Without the packed kernel (PAGEDLLM_CPU_GEMM=0, or a failed build) float32 linears hold
    oneDNN's prepacked weights, opaque tensors with no storage: counted by their elements, and
    the engine starts and decodes."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.layers import cpu_gemm_kernels
    from pagedllm.worker.worker import weight_bytes

    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.randn(32, 8).to_mkldnn(), requires_grad=False)
    assert weight_bytes(model) == 32 * 8 * 4
    monkeypatch.setenv("PAGEDLLM_CPU_GEMM", "0")
    cpu_gemm_kernels.load_cpu_gemm.cache_clear()
    cpu_gemm_kernels.load_cpu_gemm_16.cache_clear()
    try:
        llm = LLM(str(llama_model_dir), max_model_len=64)
        out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        cpu_gemm_kernels.load_cpu_gemm.cache_clear()
        cpu_gemm_kernels.load_cpu_gemm_16.cache_clear()


def test_cpu_start_up_logs_the_memory_plan(llama_model_dir, caplog):
    """The CPU start-up log gives the weights' bytes, the estimated activation peak and the KV
    pool (the engine's capacity line then gives blocks, tokens and sequences)."""
    from pagedllm.worker.worker import estimate_activation_bytes, weight_bytes

    config = EngineArgs(model=str(llama_model_dir), dtype="float32", max_model_len=128).create_engine_config()
    with caplog.at_level("INFO", logger="pagedllm.worker.worker"):
        worker = Worker(config)
        worker.load_model()
        worker.determine_num_blocks()
    weights = weight_bytes(worker.model_runner.model)
    model = worker.model_runner.model
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert 0 < weights <= held
    activations = estimate_activation_bytes(config, torch.float32)
    arch, sched = config.model_config.arch, config.scheduler_config
    assert activations > sched.max_num_batched_tokens * arch.hidden_size * 4  # at least the hidden states
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan"))
    assert f"weights {weights / GiB:.3g} GiB" in line and f"about {activations / GiB:.3g} GiB" in line
    assert "KV cache" in line
