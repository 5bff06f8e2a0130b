"""One reading of a Prometheus registry, and what a dashboard derives from it: sums over label
sets, histogram quantiles (Prometheus' ``histogram_quantile`` interpolation) and per-label
breakdowns. Reading the same registry objects /metrics exports keeps the numbers in agreement.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Sample:
    name: str  # the exposed sample name: vllm:prompt_tokens_total, ..._bucket, ..._count
    labels: dict[str, str]
    value: float


class MetricSnapshot:
    """Every sample of ``registry`` at one moment, grouped by sample name."""

    def __init__(self, registry: Any) -> None:
        self.samples: dict[str, list[Sample]] = defaultdict(list)
        for family in registry.collect():
            for s in family.samples:
                self.samples[s.name].append(Sample(s.name, dict(s.labels), float(s.value)))

    def value(self, name: str, **labels: str) -> float:
        """The sum of ``name`` over the label sets that carry ``labels`` (0 if none)."""
        return sum(s.value for s in self.samples.get(name, []) if _matches(s.labels, labels))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name`` summed per value of ``label``: ``{"stop": 3, "length": 1, ...}``."""
        out: dict[str, float] = defaultdict(float)
        for s in self.samples.get(name, []):
            if label in s.labels:
                out[s.labels[label]] += s.value
        return dict(out)

    def buckets(self, histogram: str) -> list[tuple[float, float]]:
        """The cumulative ``(le, count)`` buckets of ``histogram``, summed over label sets, by ``le``."""
        counts: dict[float, float] = defaultdict(float)
        for s in self.samples.get(histogram + "_bucket", []):
            counts[float(s.labels["le"])] += s.value
        return sorted(counts.items())

    def histogram(self, histogram: str) -> dict[str, float | None]:
        """Count, mean and the p50/p90/p99 estimates of ``histogram`` (None while it is empty)."""
        count, total = self.value(histogram + "_count"), self.value(histogram + "_sum")
        buckets = self.buckets(histogram)
        summary: dict[str, float | None] = {"count": count, "mean": total / count if count else None}
        for q in QUANTILES:
            summary[f"p{round(q * 100)}"] = histogram_quantile(q, buckets)
        return summary

    def per_label_value(self, label: str) -> dict[str, dict[str, float]]:
        """For every sample carrying ``label`` (buckets and ``_created`` aside): label value ->
        sample name -> value. What per-key accounting exports shows up here without code changes."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for name, samples in self.samples.items():
            if name.endswith(("_bucket", "_created")):
                continue
            for s in samples:
                if label in s.labels:
                    out[s.labels[label]][name] += s.value
        return {key: dict(values) for key, values in out.items()}


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' estimate: linear interpolation inside the bucket where the rank falls; a rank
    in the +Inf bucket gives the highest finite edge. None for an empty histogram."""
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for edge, count in buckets:
        if count >= rank:
            if math.isinf(edge):
                return lower
            if count == below:
                return edge
            return lower + (edge - lower) * (rank - below) / (count - below)
        lower, below = edge, count
    return lower


def _matches(labels: dict[str, str], wanted: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in wanted.items())
