"""Worker: one per device, one per TP rank or pipeline stage (executor/multiproc.py). Sets up the device, sizes the KV pool.

KV pool sizing. On CPU the pool has a fixed size (``kv_cache_memory``, 4 GiB by default). On CUDA
it gets what is left of ``gpu_memory_utilization`` of the device after the weights, the peak
activation memory of the largest step (measured by a profiling forward of
``max_num_batched_tokens`` tokens right after loading) and a reserve for CUDA graphs and the
allocator: since no step can be larger than the profiled one, no admitted load runs out of memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.distributed.pipeline import get_pp_group
from pagedllm.layers import cpu_kernels
from pagedllm.metrics.startup import StartupPhases
from pagedllm.sampling.metadata import SamplingMetadata
from pagedllm.sampling.sampler import compute_logprobs_topk
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.cuda_graph import graphs_enabled
from pagedllm.worker.flat_batch import build_flat_batch
from pagedllm.worker.host_memory import keep_freed_memory, weights_to_huge_pages
from pagedllm.worker.kv_layers import attention_layers
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.threads import set_intra_op_threads

logger = logging.getLogger(__name__)

MiB = 1 << 20
# Allocator fragmentation and buffers created after profiling (cuBLAS workspaces on new streams).
_RUNTIME_RESERVE = 256 * MiB
# Decode graphs' private memory pool: activations of at most 256 tokens plus the graphs themselves.
_CUDA_GRAPH_RESERVE = 512 * MiB


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # device memory
    used_after_load: int  # in use once the weights are loaded: ours, the CUDA context, other processes
    activation_peak: int  # torch allocations above that at the profiling forward's peak


def kv_cache_budget(profile: MemoryProfile, utilization: float, reserve: int) -> int:
    """Bytes for the KV pool: our share of the device less what is in use, the peak and the reserve."""
    return int(profile.total * utilization) - profile.used_after_load - profile.activation_peak - reserve


def measure_memory(device: torch.device, run_profile: Callable[[], None]) -> MemoryProfile:
    """What is in use after loading, and the peak extra memory of ``run_profile`` (CUDA)."""
    torch.cuda.empty_cache()  # loading's freed temporaries must not count as in use
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    run_profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - allocated
    torch.cuda.empty_cache()  # hand the activations back before the KV pool is allocated
    return MemoryProfile(total=total, used_after_load=total - free, activation_peak=peak)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers as they are held (packed or quantized),
    each storage counted once (tied embeddings share one)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_mkldnn:  # oneDNN's prepacked weights (no storage to read): their elements
            storages[id(tensor)] = tensor.numel() * tensor.element_size()
            continue
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def estimate_activation_bytes(config: EngineConfig, dtype: torch.dtype) -> int:
    """The largest step's activations, estimated from the shapes (CPU has no allocator peak to
    read): per token of ``max_num_batched_tokens`` a decoder layer's live tensors (hidden and
    residual, q/k/v, attention output, gate/up and the activation), plus float32 logits and
    their probabilities for ``max_num_seqs`` sampled rows."""
    arch = config.model_config.arch
    per_token = 2 * arch.hidden_size + 2 * arch.q_size + 2 * arch.kv_size + 3 * arch.intermediate_size
    tokens = config.scheduler_config.max_num_batched_tokens
    rows = min(config.scheduler_config.max_num_seqs, tokens)
    return tokens * per_token * dtype.itemsize + rows * arch.vocab_size * 4 * 2


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.startup = StartupPhases()  # the engine's start-up log shows where the time went
        set_intra_op_threads()
        torch.manual_seed(config.model_config.seed)
        with self.startup.phase("runner set-up"):
            self.model_runner = ModelRunner(config, self.device)

    def load_model(self) -> None:
        """Load the weights; on CPU with no cached kernel build, compile it meanwhile (reading
        the checkpoint overlaps the build; packing the weights for the GEMM waits for it)."""
        build = self._start_cpu_kernels()
        try:
            with self.startup.phase("weights" if build is None else "weights (overlapping the kernel build)"):
                self.model_runner.load_model()
        except torch.cuda.OutOfMemoryError as e:
            raise ValueError(
                f"the model's weights do not fit in the memory of {self.device}; use a smaller model "
                "(or a 16-bit --dtype)"
            ) from e
        if build is not None:  # not every model waits for it while loading; the first step must not
            with self.startup.phase("rest of the kernel build"):
                build.join()
        if self.device.type == "cpu":
            with self.startup.phase("weights into huge pages"):  # one mapping per model (a draft has its own)
                for model in self.model_runner.models:
                    weights_to_huge_pages(model)

    def _start_cpu_kernels(self) -> threading.Thread | None:
        """Load the cached CPU kernel build now, or start compiling it in the background."""
        if self.device.type != "cpu":
            return None
        with self.startup.phase("kernels"):
            level = cpu_kernels.selected_isa()  # named: build_cpu_library caches per argument
            build = cpu_kernels.start_background_build(level)
            if build is None:
                cpu_kernels.build_cpu_library(level)
        return build

    def collective_stats(self) -> dict[str, int] | None:
        """This rank's shared-memory collective counters (``ShmAllReduce.stats``), None without them."""
        shm = get_tp_group().shm
        return None if shm is None else shm.stats()

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit in the memory budget (the null block included)."""
        needed = self.config.blocks_per_max_len_request() + 1  # + the null block
        override = self.config.cache_config.num_gpu_blocks_override
        if override is not None:
            if override < needed:
                raise ValueError(
                    f"num_gpu_blocks_override={override} cannot hold one request of max_model_len="
                    f"{self.config.model_config.max_model_len} ({needed} blocks incl. the null block)"
                )
            return override
        # More blocks than every sequence at full length could use only lengthens start-up;
        # what is left over still serves the prefix cache, so keep a generous cap.
        useful = self.config.scheduler_config.max_num_seqs * self.config.blocks_per_max_len_request() + 1
        # A pipeline stage caches only its own layers: it fits more blocks than the whole model
        # would; the executor takes the fewest any stage fits.
        start, end = get_pp_group().layer_range(self.config.model_config.arch.num_hidden_layers)
        per_block = self.config.kv_bytes_per_block(end - start)
        if per_block == 0:
            return useful  # an encoder keeps no KV: its blocks are bookkeeping only
        budget = self._kv_memory_budget()
        if budget < per_block * needed:
            raise ValueError(self._too_small_message(budget, per_block * needed))
        return int(min(budget // per_block, useful))

    def _too_small_message(self, budget: int, needed: int) -> str:
        max_len = self.config.model_config.max_model_len
        head = (
            f"the KV cache budget ({max(budget, 0) / (1 << 30):.3g} GiB) cannot hold one request of "
            f"max_model_len={max_len} ({needed / (1 << 30):.3g} GiB)"
        )
        utilization = self.config.cache_config.gpu_memory_utilization
        return (
            f"{head} after the weights and the activations of max_num_batched_tokens="
            f"{self.config.scheduler_config.max_num_batched_tokens} tokens within gpu_memory_utilization="
            f"{utilization}; lower --max-model-len, raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens, or use a smaller model"
        )

    def _kv_memory_budget(self) -> int:
        if self.device.type == "cuda":
            profile = measure_memory(self.device, self._profile_run)
            graphs = graphs_enabled(self.config, self.device, self.model_runner.attn_backend)
            reserve = _RUNTIME_RESERVE + (_CUDA_GRAPH_RESERVE if graphs else 0)
            budget = kv_cache_budget(profile, self.config.cache_config.gpu_memory_utilization, reserve)
            logger.info(
                "GPU memory: %.2f GiB total, %.2f GiB in use after loading, %.2f GiB activation peak, "
                "%.2f GiB reserve -> %.2f GiB for the KV cache",
                profile.total / (1 << 30),
                profile.used_after_load / (1 << 30),
                profile.activation_peak / (1 << 30),
                reserve / (1 << 30),
                budget / (1 << 30),
            )
            return budget
        memory = self.config.cache_config.kv_cache_memory_bytes
        assert memory is not None, "CacheConfig resolves the CPU KV pool's size (config/cache.py)"
        logger.info(
            "memory plan: weights %.3g GiB%s, activations of the largest step about %.3g GiB (estimated), "
            "KV cache %.3g GiB in %s (kv_cache_memory, kv_cache_dtype)",
            weight_bytes(cast(torch.nn.Module, self.model_runner.model)) / (1 << 30),
            ""
            if self.config.parallel_config.tensor_parallel_size * self.config.parallel_config.pipeline_parallel_size
            == 1
            else " on this rank",
            estimate_activation_bytes(self.config, self.model_runner.dtype) / (1 << 30),
            memory / (1 << 30),
            self.config.cache_config.kv_cache_dtype,
        )
        return memory

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """The largest step there can be: max_num_batched_tokens prompt tokens, then sampling."""
        try:
            profile_forward(self.model_runner, self.config)
        except torch.cuda.OutOfMemoryError as e:
            raise ValueError(
                f"a step of max_num_batched_tokens={self.config.scheduler_config.max_num_batched_tokens}"
                " tokens does not fit on the device next to the model; lower --max-num-batched-tokens "
                "or --max-model-len, or use a smaller model"
            ) from e

    def initialize_kv_cache(self, num_blocks: int) -> None:
        with self.startup.phase("KV cache"):
            self.model_runner.initialize_kv_cache(num_blocks)
        if self.device.type == "cpu":  # the weights and the cache are placed: steps reuse what they free
            keep_freed_memory()
        if self.device.type == "cuda":
            with self.startup.phase("CUDA graphs"):
                self.model_runner.capture_cuda_graphs()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(sched)


def profile_lengths(num_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """Sequence lengths of the profiling batch: ``num_tokens`` split into prompts of at most
    ``max_model_len``, no more than ``max_num_seqs`` of them (a step can hold no more)."""
    num_tokens = min(num_tokens, max_model_len * max_num_seqs)
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


def profile_forward(runner: ModelRunner, config: EngineConfig) -> None:
    """Run the model and the sampler on the largest step, with KV writes into a throwaway one-block
    cache per layer (every block table entry is block 0, so attention still reads full contexts)."""
    sched = config.scheduler_config
    lengths = profile_lengths(sched.max_num_batched_tokens, config.model_config.max_model_len, sched.max_num_seqs)
    block_size = runner.block_size
    for layer in attention_layers(runner.models[:1]):  # the target's
        scratch = torch.zeros(
            2, 1, block_size, layer.num_kv_heads, layer.head_dim, dtype=runner.kv_dtype, device=runner.device
        )
        layer.bind_kv_cache(scratch, runner.attn_backend)  # replaced by initialize_kv_cache
    tables = [[0] * -(-n // block_size) for n in lengths]
    input_ids, positions, attn = build_flat_batch(
        [[0] * n for n in lengths], [0] * len(lengths), tables, block_size, runner.device
    )
    hidden = runner.model(input_ids, positions, runner.attention_metadata(attn))
    if config.model_config.is_pooling:
        return  # a pooling step computes no logits and samples nothing
    # Prompt logprobs take logits of every prompt row in the step; they are freed before sampling.
    logits = runner.model.compute_logits(hidden)
    # The most logprobs a request may ask for (max_logprobs) is what the profile takes.
    num_logprobs = config.model_config.logprobs_cap
    compute_logprobs_topk(logits, num_logprobs, torch.zeros(len(logits), dtype=torch.int64, device=runner.device))
    del logits
    spec = config.speculative_config
    rows = min(hidden.shape[0], sched.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)))
    _profile_sampler(runner, runner.model.compute_logits(hidden[:rows]), num_logprobs)


def _profile_sampler(runner: ModelRunner, logits: torch.Tensor, num_logprobs: int) -> None:
    """Sample every row with the memory-hungriest options: penalties, top-k/top-p sort, logprobs."""
    rows = logits.shape[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, repetition_penalty=1.1, logprobs=num_logprobs)
    metadata = SamplingMetadata.from_params(
        [params] * rows, [[0]] * rows, [[0]] * rows, runner.vocab_size, runner.device
    )
    runner.sampler.sample(logits, metadata)
