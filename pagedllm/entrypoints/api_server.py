"""``python -m pagedllm.entrypoints.api_server [MODEL] [--model M] [flags]``: vLLM's older module
entry point, kept so its command lines run unchanged. It starts the same server as
``pagedllm serve`` (the OpenAI-compatible API, with ``/health`` and ``/metrics``), with the
same flags: see ``pagedllm serve --help``.
"""

from __future__ import annotations

import sys

from pagedllm.entrypoints.cli import serve_main

if __name__ == "__main__":
    sys.exit(serve_main(prog="python -m pagedllm.entrypoints.api_server"))
