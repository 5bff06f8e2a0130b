"""Kept for old command lines: ``python -m benchmarks.offline_throughput ARGS`` runs
``pagedllm bench throughput --hf-baseline ARGS`` (``--skip-hf`` drops the baseline;
``--hf-batch-size B`` is ``--hf-batch-sizes B``). The code lives in ``pagedllm/entrypoints/bench/``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pagedllm.entrypoints.cli import main as cli_main


def translate(argv: Sequence[str]) -> list[str]:
    args = [a for a in argv if a != "--skip-hf"]
    args = ["--hf-batch-sizes" if a == "--hf-batch-size" else a for a in args]
    return ["bench", "throughput", *([] if "--skip-hf" in argv else ["--hf-baseline"]), *args]


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(translate(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
