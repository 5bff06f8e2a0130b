"""A real server for the reliability suite: the tiny llama model, the debug endpoints on (for the
block pool's integrity check), a small body limit (so an oversize body is cheap to send).

The short run is part of the normal suite; ``PAGEDLLM_SOAK=1`` runs the long one (more requests,
more fuzzing examples per endpoint)."""

from __future__ import annotations

import os

import pytest

from tests.entrypoints.openai.conftest import RemoteServer
from tests.server_checks import DEBUG_ENV

SOAK = os.environ.get("PAGEDLLM_SOAK") == "1"
MAX_BODY_BYTES = 256 * 1024
SERVER_ARGS = [
    "--served-model-name",
    "tiny",
    "--disable-uvicorn-access-log",
    "--max-request-body-bytes",
    str(MAX_BODY_BYTES),
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with RemoteServer(tiny_model_dir("llama"), SERVER_ARGS, env=DEBUG_ENV) as srv:
        yield srv
