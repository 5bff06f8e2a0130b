"""The step scheduler: ``SchedulerArgs`` -> frozen ``SchedulerConfig``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedllm.config.choices import SCHEDULING_POLICIES
from pagedllm.config.options import check_choice, check_positive, option

# A CPU server's step budget. On a CPU a step carrying a 2,048-token prefill chunk takes seconds
# and stalls every running stream for that long. Measured at concurrency 32 with long prompts
# arriving (docs/benchmarks.md, "Online serving"): 128 tokens keeps p99 inter-token latency
# within 2x its median (1.71) at the same output rate as 256 (7.6x) and 2,048 (65x, and a lower
# rate); the price is a longer time to first token. Offline batches keep 2,048: only throughput
# counts there.
CPU_SERVING_MAX_NUM_BATCHED_TOKENS = 128
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str  # fcfs | priority
    # Most prompt tokens one request computes in a step (0: no cap beyond the budget). A cap keeps
    # a long prompt's prefill from stalling the decodes that share its steps.
    long_prefill_token_threshold: int = 0
    # False for encoders: a prompt runs whole in one step (its attention sees every token at once).
    chunked_prefill: bool = True


def default_max_num_batched_tokens(device: str, usage_context: str) -> int:
    """The step token budget when ``max_num_batched_tokens`` is not given."""
    if device == "cpu" and usage_context == "serve":
        return CPU_SERVING_MAX_NUM_BATCHED_TOKENS
    return DEFAULT_MAX_NUM_BATCHED_TOKENS


@dataclass
class SchedulerArgs:
    """How much work one step takes and in which order requests run."""

    max_num_seqs: int = option(256, "most sequences in one step")
    max_num_batched_tokens: int | None = option(
        None,
        "token budget per step; longer prompts are chunked",
        default_help=f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}; {CPU_SERVING_MAX_NUM_BATCHED_TOKENS} for `serve` on "
        "CPU, where a bigger chunk stalls every stream for seconds",
    )
    scheduling_policy: str = option(
        "fcfs", "fcfs, or priority (lower value first; preempts the lowest priority)", choices=SCHEDULING_POLICIES
    )
    long_prefill_token_threshold: int = option(
        0,
        "most prompt tokens one request computes per step (0 = only the step budget); a cap keeps long "
        "prompts from stalling running decodes (lower inter-token latency)",
    )
    enable_chunked_prefill: bool = option(
        True,
        "split long prompts across steps under the step token budget; always on here (vLLM's flag, accepted "
        "so its command lines run; --no-enable-chunked-prefill only logs a warning: outputs are the same, "
        "only how a prompt's prefill is spread over steps differs)",
    )

    def create_scheduler_config(self, max_model_len: int, device: str, usage_context: str) -> SchedulerConfig:
        check_positive("max_num_seqs", self.max_num_seqs)
        if not self.enable_chunked_prefill:
            logger.warning(
                "enable_chunked_prefill=False (--no-enable-chunked-prefill) has no effect: chunked prefill is "
                "always on in pagedllm; long prompts are still split across steps under max_num_batched_tokens "
                "(outputs are the same, only their step timing differs)"
            )
        check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        batched = self.max_num_batched_tokens
        if batched is None:  # chunked prefill is always on: long prompts are split across steps
            batched = default_max_num_batched_tokens(device, usage_context)
        check_positive("max_num_batched_tokens", batched)
        threshold = self.long_prefill_token_threshold
        if not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0 = off), got {threshold!r}")
        return SchedulerConfig(self.max_num_seqs, batched, max_model_len, self.scheduling_policy, threshold)
