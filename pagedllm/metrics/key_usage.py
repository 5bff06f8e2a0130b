"""Per-API-key usage in Prometheus: requests, prompt and generated tokens, and rate-limit
refusals, labelled with the key's name (never the key). Counted by the HTTP server's quotas."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

PREFIX = "pagedllm:api_key_"
LIMITS = ("rpm", "tpm", "max_concurrent")


class KeyUsageMetrics:
    """Counters per key name; every key's series exist (at 0) from the start."""

    def __init__(self, registry: CollectorRegistry, model_name: str, key_names: list[str]) -> None:
        labels = ["model_name", "key_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=registry)

        self.model_name = model_name
        self._requests = counter("requests", "Requests admitted, by API key name.")
        self._prompt = counter("prompt_tokens", "Prompt tokens of finished requests, by API key name.")
        self._generation = counter("generation_tokens", "Tokens generated for finished requests, by API key name.")
        self._limited = counter(
            "rate_limited", "Requests refused with 429 by a per-key limit (rpm, tpm, max_concurrent).", ("limit",)
        )
        for name in key_names:
            for family in (self._requests, self._prompt, self._generation):
                family.labels(model_name, name)
            for limit in LIMITS:
                self._limited.labels(model_name, name, limit)

    def request(self, key_name: str) -> None:
        self._requests.labels(self.model_name, key_name).inc()

    def tokens(self, key_name: str, prompt: int, generated: int) -> None:
        self._prompt.labels(self.model_name, key_name).inc(prompt)
        self._generation.labels(self.model_name, key_name).inc(generated)

    def rate_limited(self, key_name: str, limit: str) -> None:
        self._limited.labels(self.model_name, key_name, limit).inc()
