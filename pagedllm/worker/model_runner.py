"""ModelRunner: owns the models and the KV cache tensors; turns a SchedulerOutput into sampled tokens.

One step: the input batch prepares the typed inputs, the model runs (a CUDA graph replay for
decode-only steps), the sampler draws (verifying proposals when there are any), and a proposer,
if speculating, guesses the next tokens from explicit inputs. A pooling runner (embedding
models) stops after the forward: its pooler turns the prompts that end in the step into
embeddings, and nothing samples.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, cast

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.pipeline import get_pp_group
from pagedllm.layers.attention.metadata import CommonAttentionMetadata
from pagedllm.layers.attention.selector import get_attn_backend
from pagedllm.lora.context import lora_step
from pagedllm.lora.manager import LoRAModelManager
from pagedllm.models.loader import load_model
from pagedllm.models.stage import IntermediateTensors
from pagedllm.sampling.sampler import Sampler
from pagedllm.spec_decode.factory import make_proposer
from pagedllm.spec_decode.proposer import Proposer
from pagedllm.structured_output.bitmask import apply_grammar_bitmask
from pagedllm.worker.batch_inputs import BatchInputs
from pagedllm.worker.causal_lm import CausalLM
from pagedllm.worker.cuda_graph import CudaGraphRunner, capture_sizes, graphs_enabled
from pagedllm.worker.host_memory import KVPrefaulter
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.kv_layers import attention_layers, bind_kv_caches
from pagedllm.worker.kv_tier import KVTier
from pagedllm.worker.pooler import Pooler
from pagedllm.worker.request_state import CachedRequestState, newest_block, update_states
from pagedllm.worker.staging import HostStager
from pagedllm.worker.step_output import prompt_logprobs, split_logprobs

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Owns the target model (and a proposer's), the KV caches and the per-request worker state;
    ``execute_model`` runs one step."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.dtype = _TORCH_DTYPES[config.model_config.dtype]
        self.kv_dtype = _TORCH_DTYPES[config.cache_config.kv_cache_dtype]  # the model's, or --kv-cache-dtype
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.arch.vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        # The step's requests as persistent rows (and their sampling metadata). Its stager: one
        # pinned buffer, one host-to-device copy per step (CUDA).
        self.input_batch = InputBatch(self.block_size, self.vocab_size, HostStager(device))
        self.sampler = Sampler()
        self.attn_backend = get_attn_backend(device.type, config.attention_backend)
        self._model: CausalLM | None = None  # the target: ``model`` once loaded
        self.models: list[torch.nn.Module] = []  # every model with KV: the target, then a draft model
        self.kv_caches: list[torch.Tensor] = []
        self.kv_tier = KVTier([], 0)  # the swap tier (--swap-space), set up with the KV caches
        self.kv_prefault: KVPrefaulter | None = None  # CPU: the cache's pages touched ahead of use
        self.proposer: Proposer | None = None  # speculative decoding: set up in load_model
        self.cuda_graphs: CudaGraphRunner | None = None  # decode-only steps replay these (CUDA)
        self.lora: LoRAModelManager | None = None  # the adapters' slots (--enable-lora)
        pooler_config = config.model_config.pooler_config
        self.pooler = Pooler(pooler_config) if config.model_config.is_pooling and pooler_config else None
        # An encoder attends bidirectionally over whole prompts and keeps no KV: its attention
        # reads the flat batch's layout (CommonAttentionMetadata), not a paged backend's metadata.
        self.encoder_only = config.model_config.arch.encoder_only
        self.pp = get_pp_group()  # a pipeline stage: hands its hidden states on unless it is the last

    @property
    def model(self) -> CausalLM:
        """The target model (replaceable by a stand-in, e.g. the benchmark's timed wrapper)."""
        if self._model is None:
            raise RuntimeError("load_model() first")
        return self._model

    @model.setter
    def model(self, model: CausalLM) -> None:
        self._model = model

    # ------------------------------------------------------------------ set-up
    def load_model(self) -> None:
        mc = self.config.model_config
        model = load_model(
            mc.model,
            mc.arch,
            load_format=mc.load_format,
            dtype=self.dtype,
            device=self.device,
            seed=mc.seed,
            quantization=mc.quantization,
        )
        self._model = cast(CausalLM, model)
        self._attach_lora(model)
        self.proposer = make_proposer(self.config, self.device, self.dtype, self.attn_backend, self.input_batch.stager)
        self.models = [model, *(self.proposer.models if self.proposer is not None else [])]

    def _attach_lora(self, model: torch.nn.Module) -> None:
        """With --enable-lora: slots on the target model's linears (the draft model runs without)."""
        lora_config = self.config.lora_config
        if lora_config is not None:
            self.lora = LoRAModelManager(model, lora_config, self.config.model_config.arch, self.dtype, self.device)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Give every attention layer of every model its own cache over the same block ids."""
        self.kv_caches = bind_kv_caches(
            attention_layers(self.models), num_blocks, self.block_size, self.kv_dtype, self.device, self.attn_backend
        )
        self.kv_tier = KVTier(self.kv_caches, self.config.num_swap_blocks())
        self.kv_prefault = KVPrefaulter.for_caches(self.kv_caches, num_blocks)

    def capture_cuda_graphs(self) -> None:
        """Capture decode-only forwards (after the KV cache is bound: the graphs bake in its address)."""
        if not graphs_enabled(self.config, self.device, self.attn_backend):
            return
        sizes = capture_sizes(self.config.scheduler_config.max_num_seqs)
        self.cuda_graphs = CudaGraphRunner(
            self.model,
            self.attn_backend,
            sizes,
            self.config.blocks_per_max_len_request(),
            self.block_size,
            self.config.model_config.max_model_len,
            self.device,
        )
        seconds = self.cuda_graphs.capture()
        logger.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s (--enforce-eager turns them off)", sizes, seconds
        )

    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        update_states(self.requests, sched, self._make_generator)
        if self.kv_prefault is not None and self.kv_prefault.active:
            self.kv_prefault.saw(newest_block(sched))
        if sched.scheduled_cached_reqs.new_token_ids:
            self._take_sampled(sched)
        self.kv_tier.copy(
            sched.kv_swap_out, sched.kv_swap_in, sched.kv_block_copies
        )  # before the forward writes any block
        self.input_batch.sync(self.requests, sched)  # an empty step empties the rows too
        if self.pooler is not None:
            self.pooler.forget(sched.finished_req_ids)
        if sched.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        batch = self.input_batch.prepare(sched, sampling=self.pooler is None and self.pp.is_last)
        if not self.pp.is_last:
            return self._run_earlier_stage(batch)
        lora_mapping, errors = self._prepare_lora(batch)
        hidden = self._forward(batch, lora_mapping)
        if self.pooler is not None:
            return ModelRunnerOutput(sampled_token_ids={}, pooler_output=self.pooler(batch, hidden, self.requests))
        output = ModelRunnerOutput(sampled_token_ids={r: [] for r in batch.req_ids}, errors=errors)
        prompt_logprobs(batch, hidden, self.requests, self.model.compute_logits, output.prompt_logprobs)
        emitted = self._sample(batch, hidden, output, sched.grammar_bitmask) if batch.sampling is not None else []
        # Every step, sampled or not: a draft model must see each prefill chunk to keep its KV whole.
        if self.proposer is not None:
            self._propose(batch, hidden, emitted, output, sched.spec_token_limits)
        return output

    def _forward(self, batch: BatchInputs, lora_mapping: Any = None) -> torch.Tensor:
        """Hidden states [T, hidden]: a CUDA graph replay for decode-only steps, else eager."""
        if self.pp.size > 1:
            out = self._stage_forward(batch)
            assert isinstance(out, torch.Tensor), "the last stage ends with the final norm"
            return out
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(batch):
            return self.cuda_graphs.run(batch)
        scope = contextlib.nullcontext() if lora_mapping is None else lora_step(lora_mapping)
        with scope:
            return self.model(batch.input_ids, batch.positions, self.attention_metadata(batch.attn))

    def _stage_forward(self, batch: BatchInputs) -> torch.Tensor | IntermediateTensors:
        """A pipeline stage's forward: from the previous stage's tensors unless it is the first."""
        intermediate = None
        if not self.pp.is_first:
            hidden_size = self.config.model_config.arch.hidden_size
            intermediate = IntermediateTensors(*self.pp.recv(len(batch.input_ids), hidden_size, self.dtype))
        stage = cast(Any, self.model)  # CausalLM types the single-stage call only
        out = stage(batch.input_ids, batch.positions, self.attention_metadata(batch.attn), intermediate)
        return cast(torch.Tensor | IntermediateTensors, out)

    def _run_earlier_stage(self, batch: BatchInputs) -> ModelRunnerOutput:
        """A stage before the last: run its layers and hand the result on. It never waits for the
        last stage: the tokens that one samples reach it in a later step's plan."""
        out = self._stage_forward(batch)
        assert isinstance(out, IntermediateTensors), "only the last stage ends with the final norm"
        self.pp.send(out.hidden_states, out.residual)
        return ModelRunnerOutput(sampled_token_ids={})  # the last stage's output is the step's

    def _take_sampled(self, sched: SchedulerOutput) -> None:
        """Pipeline stages: append the output tokens a request computes this step that this rank
        has not seen (a stage before the last samples nothing itself; the last one has them all)."""
        cached = sched.scheduled_cached_reqs
        for req_id, computed, tokens in zip(cached.req_ids, cached.num_computed_tokens, cached.new_token_ids):
            state = self.requests[req_id]
            missing = computed + sched.num_scheduled_tokens[req_id] - state.num_tokens
            if missing > 0:
                state.output_token_ids.extend(tokens[-missing:])
                if req_id in self.input_batch.row_of:
                    self.input_batch.append_tokens(req_id, tokens[-missing:])

    def _prepare_lora(self, batch: BatchInputs) -> tuple[Any, dict[str, str]]:
        """The step's LoRA mapping (None when no row runs an adapter), and req_id -> why for the
        requests whose adapter failed to load: their rows run the base model and the scheduler
        fails them, so none of that output reaches a client."""
        if self.lora is None or batch.lora is None:
            return None, {}
        mapping, failed = self.lora.prepare(batch.lora.token_lora_ids, batch.lora.requests)
        errors = {}
        for req_id in batch.req_ids if failed else ():
            lora = self.requests[req_id].lora_request
            if lora is not None and lora.lora_int_id in failed:
                errors[req_id] = failed[lora.lora_int_id]
        return mapping, errors

    def attention_metadata(self, attn: CommonAttentionMetadata) -> Any:
        """What the model's attention reads: the backend's metadata, or for an encoder the layout."""
        return attn if self.encoder_only else self.attn_backend.build_metadata(attn)

    def _sample(
        self, batch: BatchInputs, hidden: torch.Tensor, output: ModelRunnerOutput, grammar_bitmask: Any = None
    ) -> list[list[int]]:
        """Sample the step's logits rows; record and report what each request emits."""
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if grammar_bitmask is not None:  # constrained rows only (never speculated)
            apply_grammar_bitmask(logits, grammar_bitmask, batch.logits_req_ids)
        assert batch.sampling is not None, "called only for steps that sample"
        result = self.sampler.sample(logits, batch.sampling, batch.drafts)
        emitted = result.token_ids
        self.input_batch.record_sampled(batch, emitted)
        output.sampled_token_ids.update(zip(batch.sample_req_ids, emitted))
        if result.logprobs_tensors is not None:
            states = [self.requests[r] for r in batch.sample_req_ids]
            split_logprobs(result.logprobs_tensors, states, emitted, batch.rows_per_request, output.logprobs)
        return emitted

    def _propose(
        self,
        batch: BatchInputs,
        hidden: torch.Tensor,
        emitted: list[list[int]],
        output: ModelRunnerOutput,
        limits: dict[str, int],
    ) -> None:
        """Guess the next tokens of the requests that just sampled (speculative decoding), at most
        ``limits[req_id]`` of them where the scheduler caps a request."""
        spec, proposer = self.config.speculative_config, self.proposer
        assert spec is not None and proposer is not None, "a proposer exists only with a speculative config"
        inputs = self.input_batch.proposer_inputs(
            batch, hidden, emitted, spec.num_speculative_tokens, self.config.model_config.max_model_len, limits
        )
        proposals = proposer.propose(inputs)
        self.input_batch.set_proposals(batch, proposals)
        output.spec_token_ids = proposals.token_ids
