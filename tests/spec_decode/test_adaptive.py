"""The adaptive speculation policy: limits from acceptance and measured step cost (torch-free).

The policy runs on a fake clock; the scheduler tests drive the scheduler by hand as a worker
that obeys the limits would, accepting or rejecting every proposal.
"""

from __future__ import annotations

import random

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.adaptive import (
    ACCEPTANCE_DECAY,
    CALIBRATION_INTERVAL,
    FIRST_PROBE_INTERVAL,
    MAX_PROBE_INTERVAL,
    PRIOR_DRAFT_COST,
    SpeculationPolicy,
)

K = 4


class FakeDevice:
    """A clock on which a decode step of ``batch`` requests takes ``plain`` seconds plus
    ``per_draft`` per verified proposal."""

    def __init__(self, plain: float = 0.02, per_draft: float = 0.0) -> None:
        self.now, self.plain, self.per_draft = 0.0, plain, per_draft

    def clock(self) -> float:
        return self.now

    def run(self, drafts: int) -> None:
        self.now += self.plain + self.per_draft * drafts


class Decoder:
    """Request "a" decoding alone: each step verifies as many proposals as its last limit
    allowed, each accepted with probability ``alpha`` if the ones before it were."""

    def __init__(self, per_draft: float) -> None:
        self.device = FakeDevice(per_draft=per_draft)
        self.policy = SpeculationPolicy(K, self.device.clock)
        self.limit = K
        self.rng = random.Random(0)

    def run(self, steps: int, alpha: float) -> list[int]:
        """The limit after each of ``steps`` steps."""
        limits = []
        for _ in range(steps):
            drafts = [7] * self.limit
            self.limit = self.policy.limits({"a": 1 + len(drafts)}, {"a": drafts}).get("a", K)
            self.device.run(len(drafts))
            self.policy.end_step({"a": 1 + len(drafts)}, {"a": drafts})
            if drafts:
                accepted = 0
                while accepted < len(drafts) and self.rng.random() < alpha:
                    accepted += 1
                self.policy.observe("a", len(drafts), accepted)
            limits.append(self.limit)
        return limits


def test_new_requests_speculate_fully_and_full_acceptance_keeps_it():
    decoder = Decoder(per_draft=0.004)  # a draft costs a fifth of a plain step
    assert decoder.policy.limits({"b": 1, "c": 1}, {}) == {}  # nothing capped
    limits = decoder.run(200, alpha=1.0)
    # All K but the calibration steps (every CALIBRATION_INTERVAL at most) that time a plain step.
    assert limits.count(K) >= len(limits) - len(limits) // CALIBRATION_INTERVAL
    assert 0.05 < decoder.policy.draft_cost(1) < 0.3


def test_rejections_back_off_to_plain_decoding_step_by_step():
    limits = Decoder(per_draft=0.001).run(FIRST_PROBE_INTERVAL + 4, alpha=0.0)
    assert limits == sorted(limits, reverse=True)  # never up while everything is rejected
    assert limits[1] < K and limits[-1] == 0  # limits[0] came before the first verification
    assert len(set(limits)) > 2  # through intermediate limits, not straight to 0


def test_probes_come_back_at_doubling_intervals_until_one_succeeds():
    decoder = Decoder(per_draft=0.002)
    limits = decoder.run(400, alpha=0.0)
    first_zero = limits.index(0)
    probes = [i for i in range(first_zero, len(limits)) if limits[i]]
    assert all(limits[i] == 1 for i in probes)  # a probe is one proposal
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[0] > FIRST_PROBE_INTERVAL and gaps[-1] == MAX_PROBE_INTERVAL + 2
    assert probes[0] - first_zero == FIRST_PROBE_INTERVAL  # after that many plain steps

    # The text turns repetitive: within one probe interval, the request speculates fully again.
    limits = decoder.run(MAX_PROBE_INTERVAL + 12, alpha=1.0)
    assert limits[-1] == K and limits.index(K) <= MAX_PROBE_INTERVAL + 12


@pytest.mark.parametrize(("per_draft", "backs_off"), [(0.001, False), (0.018, True)])
def test_the_limit_follows_the_measured_cost_of_a_draft(per_draft, backs_off):
    """Half the proposals accepted: worth it when a draft costs a twentieth of a plain step,
    not when it costs nine tenths."""
    decoder = Decoder(per_draft=per_draft)
    limits = decoder.run(200, alpha=0.5)
    late = limits[-50:]
    if backs_off:
        assert decoder.policy.draft_cost(1) > 0.2
        assert max(late) <= 1 and late.count(1) <= 2  # plain decoding, rare probes
    else:
        assert decoder.policy.draft_cost(1) == pytest.approx(0.05, rel=0.3)
        assert sum(late) / len(late) >= 2


def test_cost_prior_until_drafts_vary_and_prefill_steps_are_not_timed():
    device = FakeDevice(per_draft=0.01)
    policy = SpeculationPolicy(K, device.clock)
    assert policy.draft_cost(1) == PRIOR_DRAFT_COST
    drafts = {"a": [7] * K}
    for _ in range(10):  # every step verifies K drafts: the slope cannot be told from the intercept
        policy.limits({"a": 1 + K}, drafts)
        device.run(K)
        policy.end_step({"a": 1 + K}, drafts)
    assert policy.draft_cost(1) == pytest.approx(PRIOR_DRAFT_COST, rel=0.05)
    policy.limits({"a": 64}, {})
    device.now += 100.0  # a long prefill chunk: not a decode step
    policy.end_step({"a": 64}, {})
    assert policy.draft_cost(1) == pytest.approx(PRIOR_DRAFT_COST, rel=0.05)


def test_forget_drops_the_request():
    policy = SpeculationPolicy(K)
    policy.limits({"a": 1}, {})
    policy.observe("a", K, 0)
    # The prior's one success decays; the rejected first proposal is one trial, the rest none.
    assert policy.acceptance("a") == pytest.approx(ACCEPTANCE_DECAY / (ACCEPTANCE_DECAY + 1))
    policy.forget("a")
    assert policy.acceptance("a") is None


# --- in the scheduler --------------------------------------------------------------------------


def _scheduler(adaptive: bool = True) -> tuple[Scheduler, FakeDevice]:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=512, policy="fcfs"),
        CacheConfig(16, None, 0.9, True),
        64,
        SpeculativeConfig("ngram", K, adaptive=adaptive),
    )
    device = FakeDevice(per_draft=0.002)
    if scheduler.spec_policy is not None:
        scheduler.spec_policy.clock = device.clock
    return scheduler, device


def _drive(scheduler: Scheduler, device: FakeDevice, request: Request, steps: int, accept: bool) -> list[int]:
    """Steps of a worker that proposes as many tokens as allowed and accepts all or none of them;
    returns the proposals verified at each step."""
    verified = []
    for _ in range(steps):
        out = scheduler.schedule()
        drafts = out.scheduled_spec_decode_tokens.get(request.request_id, [])
        device.run(len(drafts))
        verified.append(len(drafts))
        emitted = (list(drafts) if accept else []) + [7]
        limit = out.spec_token_limits.get(request.request_id, K)
        scheduler.update_from_output(
            out, ModelRunnerOutput({request.request_id: emitted}, spec_token_ids={request.request_id: [7] * limit})
        )
    return verified


def test_scheduler_backs_off_reprobes_and_frees_blocks():
    scheduler, device = _scheduler()
    request = Request("a", list(range(100, 140)), SamplingParams(ignore_eos=True, max_tokens=400), 2)
    scheduler.add_request(request)
    rejected = _drive(scheduler, device, request, 150, accept=False)
    assert rejected[1] == K  # the first proposals are full
    assert sum(rejected[-100:]) <= 100 // FIRST_PROBE_INTERVAL  # then probes of one token, ever rarer
    accepted = _drive(scheduler, device, request, MAX_PROBE_INTERVAL + 12, accept=True)
    assert accepted[-1] == K  # speculation is back
    scheduler.finish_requests(["a"], request.status.FINISHED_ABORTED)
    assert scheduler.spec_policy is not None and scheduler.spec_policy.acceptance("a") is None
    scheduler.check_integrity()


def test_scheduler_without_adaptive_sends_no_limits():
    scheduler, device = _scheduler(adaptive=False)
    assert scheduler.spec_policy is None
    request = Request("a", list(range(100, 140)), SamplingParams(ignore_eos=True, max_tokens=400), 2)
    scheduler.add_request(request)
    assert _drive(scheduler, device, request, 30, accept=False)[1:] == [K] * 29
    scheduler.check_integrity()
