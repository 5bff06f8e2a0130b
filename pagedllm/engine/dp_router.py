"""Which data-parallel engine core gets a request: the least-loaded one, unless another core
recently served the same prompt start (prefix-cache affinity) and is not much busier.

Load of a core = its running + waiting requests as it last reported them (every step's
``SchedulerStats``), plus the requests routed to it since that report (so a burst that arrives
between two reports spreads out instead of piling onto one core). Ties go to the lowest index.

Affinity: a bounded LRU map from the hash of a prompt's first KV block (its tokens, with the
cache salt and LoRA adapter, which partition the prefix cache) to the core that last got such a
prompt. The request goes there while that core's load is at most ``2 * least + AFFINITY_SLACK``
(``least``: the least-loaded core's load); beyond that it yields to load and goes to the
least-loaded core, which then becomes the prefix's owner. Prompts shorter than one block, and
engines without prefix caching, are routed by load alone. Pure bookkeeping: no I/O, no processes.
"""

from __future__ import annotations

from collections import OrderedDict

AFFINITY_ENTRIES = 4096  # prefixes remembered (least recently routed dropped first)
AFFINITY_SLACK = 4  # requests an affine core may be ahead of twice the least load


class DPRouter:
    def __init__(self, num_engines: int, block_size: int | None, max_entries: int = AFFINITY_ENTRIES) -> None:
        """``block_size``: the KV block size (the affinity key covers one block); None: no affinity."""
        self.block_size = block_size
        self.max_entries = max_entries
        self.reported = [0] * num_engines  # running + waiting, as each core last said
        self.sent = [0] * num_engines  # routed since that report
        self._owners: OrderedDict[int, int] = OrderedDict()  # first-block hash -> core

    def load(self, engine: int) -> int:
        return self.reported[engine] + self.sent[engine]

    def least_loaded(self) -> int:
        return min(range(len(self.reported)), key=lambda i: (self.load(i), i))

    def route(self, prompt_token_ids: list[int], cache_salt: str | None = None, lora: str | None = None) -> int:
        """The core for a new request; counts it on that core until the core's next report."""
        best = self.least_loaded()
        key = self.prefix_key(prompt_token_ids, cache_salt, lora)
        owner = self._owners.get(key) if key is not None else None
        chosen = owner if owner is not None and self.affinity_holds(owner, best) else best
        if key is not None:
            self._remember(key, chosen)
        self.sent[chosen] += 1
        return chosen

    def affinity_holds(self, owner: int, best: int) -> bool:
        return self.load(owner) <= 2 * self.load(best) + AFFINITY_SLACK

    def report(self, engine: int, num_running: int, num_waiting: int) -> None:
        """A core's fresh scheduler counts: they now include what was routed to it before."""
        self.reported[engine] = num_running + num_waiting
        self.sent[engine] = 0

    def prefix_key(self, prompt_token_ids: list[int], cache_salt: str | None, lora: str | None) -> int | None:
        if self.block_size is None or len(prompt_token_ids) < self.block_size:
            return None
        return hash((cache_salt, lora, tuple(prompt_token_ids[: self.block_size])))

    def _remember(self, key: int, engine: int) -> None:
        self._owners[key] = engine
        self._owners.move_to_end(key)
        if len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)
