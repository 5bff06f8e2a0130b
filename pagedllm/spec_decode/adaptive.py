"""Adaptive speculation: how many proposals each request may get next step (torch-free).

A proposal is worth verifying when the tokens it is expected to add pay for the step time it
costs. Two measurements decide it, both kept here and nowhere else:

* per request, the acceptance rate ``alpha``: the chance that a proposal is accepted given that
  the ones before it were, from decayed counts of the request's verified proposals (the
  geometric model: proposal j survives with probability ``alpha ** j``);
* per batch size, the cost of a proposal ``rho``: the step time one verified proposal adds, in
  units of the time a plain step spends per request (so a proposal accepted with probability
  ``rho`` breaks even). Fitted from the wall time of the scheduler's own decode steps as
  ``time = plain + per_draft * drafts``, and drawn towards a prior while steps have not varied
  their drafts enough to tell the two apart.

The limit is the largest ``j <= num_speculative_tokens`` with ``alpha ** j >= rho``: each further
proposal must be expected to gain more than it costs. A request whose limit falls to 0 decodes
plainly; after ``interval`` steps it may propose one token again (a probe), and each probe that
fails doubles the interval, up to ``MAX_PROBE_INTERVAL``, so text that turns repetitive later gets
speculation back within a bounded number of steps. The limit never changes what is sampled,
only how many proposals are verified.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

ACCEPTANCE_DECAY = 0.8  # per verification: the last ~5 verifications dominate a request's alpha
COST_DECAY = 0.98  # per decode step: the fit follows the last ~50 steps (context grows, load moves)
PRIOR_DRAFT_COST = 0.05  # rho before steps tell: a draft row costs a twentieth of a plain row
# rho's floor, where the steps say drafts are free: a proposal accepted less than one time in a
# hundred is not worth its bookkeeping, nor worth trusting a noisy fit for.
MIN_DRAFT_COST = 0.01
# The prior counts as this many (drafts / batch)**2 of spread in the fit; steps whose drafts
# spread less than twice that get a calibration step (no proposals) once per interval.
PRIOR_WEIGHT = 4.0
CALIBRATION_INTERVAL = 32
FIRST_PROBE_INTERVAL = 8  # plain steps before a backed-off request probes again
MAX_PROBE_INTERVAL = 64
OUTLIER_FACTOR = 3.0  # a step slower than this times the fit's prediction counts as this


@dataclass
class _Acceptance:
    """A request's decayed verification counts: ``hits`` accepted of ``trials`` proposals reached."""

    hits: float = 1.0  # the prior: alpha = 1, worth one trial, so a new request speculates fully
    trials: float = 1.0
    idle: int = 0  # plain steps since its limit fell to 0
    interval: int = FIRST_PROBE_INTERVAL
    probing: bool = False  # a one-token probe is allowed until one is verified

    @property
    def alpha(self) -> float:
        return self.hits / self.trials

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        # A proposal is a trial only if every one before it was accepted: the first rejected
        # one ends the verification, the ones after it tell nothing about alpha.
        self.hits = ACCEPTANCE_DECAY * self.hits + num_accepted
        self.trials = ACCEPTANCE_DECAY * self.trials + num_accepted + (num_accepted < num_drafts)
        if self.probing:  # the next probe waits longer if this one failed
            self.probing, self.idle = False, 0
            if num_accepted < num_drafts:
                self.interval = min(2 * self.interval, MAX_PROBE_INTERVAL)

    def limit(self, rho: float, k: int, verifying: int) -> int:
        """The next proposals' limit; ``verifying``: proposals this step verifies."""
        limit = _best_limit(self.alpha, rho, k)
        if limit:
            self.idle, self.interval, self.probing = 0, FIRST_PROBE_INTERVAL, False
            return limit
        if not self.probing:
            self.idle += 1
            self.probing = self.idle > self.interval
        # While a probe is being verified, wait for its result rather than send another.
        return int(self.probing and not verifying)


@dataclass
class _CostFit:
    """Decayed least squares of decode-step time against verified drafts, for one batch-size class."""

    n: float = 0.0  # the sums, each term weighted by COST_DECAY ** age
    batch: float = 0.0
    drafts: float = 0.0
    drafts_sq: float = 0.0
    time: float = 0.0
    drafts_time: float = 0.0
    _fit: tuple[float, float] | None = field(default=None, repr=False)  # (plain, per_draft), cached

    def add(self, batch: int, drafts: int, seconds: float) -> None:
        if self.n:
            plain, per_draft = self.line()
            seconds = min(seconds, OUTLIER_FACTOR * (plain + per_draft * drafts))
        d = COST_DECAY
        self.n = d * self.n + 1
        self.batch = d * self.batch + batch
        self.drafts = d * self.drafts + drafts
        self.drafts_sq = d * self.drafts_sq + drafts * drafts
        self.time = d * self.time + seconds
        self.drafts_time = d * self.drafts_time + drafts * seconds
        self._fit = None

    def line(self) -> tuple[float, float]:
        """(plain step time, time per draft). The slope is a ridge estimate drawn towards
        ``PRIOR_DRAFT_COST * plain / batch``; solving for both at once keeps the prior
        meaningful when every step verified the same number of drafts (slope unknown)."""
        if self._fit is None:
            mean_d, mean_t, mean_b = self.drafts / self.n, self.time / self.n, self.batch / self.n
            sxx, weight = self.spread(), PRIOR_WEIGHT * mean_b * mean_b
            sxy = self.drafts_time - self.drafts * mean_t
            p = sxy / (sxx + weight)
            q = weight * PRIOR_DRAFT_COST / (mean_b * (sxx + weight))
            plain = (mean_t - mean_d * p) / (1 + mean_d * q)
            self._fit = (plain, max(p + q * plain, 0.0))
        return self._fit

    def spread(self) -> float:
        """The decayed sum of squared deviations of the drafts from their mean."""
        return self.drafts_sq - self.drafts * self.drafts / self.n

    def needs_calibration(self) -> bool:
        """Too little spread in the drafts per step to tell a draft's cost from the plain step's."""
        mean_b = self.batch / self.n
        return self.spread() < 2 * PRIOR_WEIGHT * mean_b * mean_b

    def draft_cost(self) -> float:
        """rho: one draft's time over a plain step's time per request."""
        plain, per_draft = self.line()
        return max(per_draft * (self.batch / self.n) / plain, MIN_DRAFT_COST) if plain > 0 else PRIOR_DRAFT_COST


class SpeculationPolicy:
    """The scheduler's side of speculation: per-request limits on the next proposals.

    Each step: ``limits`` when the step is planned (it starts the step's clock), ``observe`` for
    every request that verified proposals, ``end_step`` once the step's results are in, and
    ``forget`` when a request leaves."""

    def __init__(self, num_speculative_tokens: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.k = num_speculative_tokens
        self.clock = clock
        self._requests: dict[str, _Acceptance] = {}
        self._fits: dict[int, _CostFit] = {}
        self._started = 0.0
        self._since_calibration = 0

    def limits(self, num_scheduled_tokens: dict[str, int], spec_tokens: dict[str, list[int]]) -> dict[str, int]:
        """The step's requests whose next proposals are capped below ``num_speculative_tokens``
        (``spec_tokens``: the proposals this step verifies)."""
        batch = len(num_scheduled_tokens)
        rho = self.draft_cost(batch)
        capped = {}
        for req_id in num_scheduled_tokens:
            state = self._requests.setdefault(req_id, _Acceptance())
            limit = state.limit(rho, self.k, len(spec_tokens.get(req_id, ())))
            if limit < self.k:
                capped[req_id] = limit
        self._since_calibration += 1
        fit = self._fits.get(batch.bit_length())
        if fit is not None and fit.needs_calibration() and self._since_calibration >= CALIBRATION_INTERVAL:
            # Next step verifies nothing: a plain step, so a draft's cost becomes measurable.
            self._since_calibration = 0
            capped = dict.fromkeys(num_scheduled_tokens, 0)
        self._started = self.clock()
        return capped

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A request verified ``num_drafts`` proposals this step and accepted ``num_accepted``."""
        self._requests.setdefault(req_id, _Acceptance()).observe(num_drafts, num_accepted)

    def end_step(self, num_scheduled_tokens: dict[str, int], spec_tokens: dict[str, list[int]]) -> None:
        """Time the step; only decode steps (one real token per request) enter the cost fit,
        prefill chunks cost what their length does, not what their proposals do."""
        seconds = self.clock() - self._started
        drafts = 0
        for req_id, num_tokens in num_scheduled_tokens.items():
            num_drafts = len(spec_tokens.get(req_id, ()))
            if num_tokens != 1 + num_drafts:
                return
            drafts += num_drafts
        if num_scheduled_tokens:
            batch = len(num_scheduled_tokens)
            self._fits.setdefault(batch.bit_length(), _CostFit()).add(batch, drafts, seconds)

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def draft_cost(self, batch: int) -> float:
        """rho for a step of ``batch`` requests (the prior until such steps have been timed)."""
        fit = self._fits.get(batch.bit_length())
        return PRIOR_DRAFT_COST if fit is None else fit.draft_cost()

    def acceptance(self, req_id: str) -> float | None:
        """A request's current alpha (None: not seen)."""
        state = self._requests.get(req_id)
        return None if state is None else state.alpha


def _best_limit(alpha: float, rho: float, k: int) -> int:
    """The largest j <= k with alpha ** j >= rho: proposal j is expected to be accepted (and so
    to add a token) with probability alpha ** j, and costs rho of a token."""
    limit, survive = 0, 1.0
    while limit < k:
        survive *= alpha
        if survive < rho:
            break
        limit += 1
    return limit
