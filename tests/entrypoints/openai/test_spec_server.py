"""Speculative decoding behind the server: same text as without it, counters on /metrics."""

from __future__ import annotations

import subprocess
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.openai.conftest import RemoteServer

PROMPT = "one two three one two three one two three one two"


def _complete(server: RemoteServer) -> str:
    out = server.openai_client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def _spec_counters(server: RemoteServer) -> dict[str, float]:
    text = httpx.get(server.url_for("metrics")).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm:spec_decode_num") and "position" not in s.labels
    }


def test_ngram_server_matches_plain_server_and_counts_drafts(server_model_dir):
    with RemoteServer(server_model_dir, ["--served-model-name", "tiny"]) as plain:
        expected = _complete(plain)
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    with RemoteServer(server_model_dir, ["--served-model-name", "tiny", "--speculative-config", spec]) as srv:
        assert _complete(srv) == expected
        counters = _spec_counters(srv)
    assert counters["vllm:spec_decode_num_drafts_total"] > 0
    assert counters["vllm:spec_decode_num_draft_tokens_total"] >= counters["vllm:spec_decode_num_drafts_total"]
    assert (
        0
        <= counters["vllm:spec_decode_num_accepted_tokens_total"]
        <= counters["vllm:spec_decode_num_draft_tokens_total"]
    )


def test_bad_speculative_config_fails_at_start_up(server_model_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "serve",
            str(server_model_dir),
            "--speculative-config",
            '{"method": "medusa", "num_speculative_tokens": 2}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "speculative method 'medusa' does not exist" in proc.stderr
