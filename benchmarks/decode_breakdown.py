"""Where a CPU decode step's time goes, phase by phase of the one-call decode stack.

    python -m benchmarks.decode_breakdown [--batch-sizes 1 16 64] [--quantization int4]
                                          [--context 32] [--steps 30] [--settle 2]

An engine on the SmolLM-135M-shaped dummy model (float32 weights, or ``--quantization``) holds B
running requests of ``--context`` prompt tokens, in a KV pool sized to the timed steps. After a
warm-up and ``--settle`` seconds (the KV prefaulter faults the pool in during that time, not in
the timed steps: on a VM a first touch of fresh pages costs more than the step's writes), ``--steps`` decode steps are
timed whole while the decode stack's op times its own phases (``decode_stack_phases``: norms, the
four projections, RoPE, the K/V write, attention, SiLU, the TP all-reduce) and the engine probe
of ``bench latency`` times the model's forward and LM head. Reported per batch size: each
phase's milliseconds per step and share of the step, the embedding and LM head (the model's time
outside the stack), and the engine's time outside the model (sampler, scheduler, Python). The kernel build is the
engine's (``PAGEDLLM_CPU_ISA`` picks another). The last stdout line is the report as JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.decoding import decoding_engine
from pagedllm.entrypoints.bench.common import env_line, environment, format_table, write_dummy_model_dir
from pagedllm.entrypoints.bench.engine_probe import EngineProbe
from pagedllm.layers.cpu_decode_stack import STACK_PHASES, stack_phase_seconds
from pagedllm.layers.cpu_kernels import kernel_build


def breakdown(model_dir: Path, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """One batch size: each phase's ms per step (sums over the timed steps, divided), the
    embedding and LM head, the rest of the engine, and the whole step."""
    # A pool as big as the timed steps need, faulted in during the settle time.
    engine = decoding_engine(
        model_dir,
        batch,
        args.context,
        args.seed,
        args.steps + 32,
        pool_tokens=args.context + args.steps + 64,
        quantization=args.quantization,
    )
    probe = EngineProbe(engine, "cpu")  # times the model's forward and LM head inside each step
    time.sleep(args.settle)
    probe.reset()
    stack_phase_seconds(True)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - start) / args.steps
    phases, steps = stack_phase_seconds(False)
    model_s = probe.model.seconds / args.steps
    engine.abort_request([str(i) for i in range(batch)])
    engine.step()
    engine.check_integrity()
    if steps != args.steps:
        raise SystemExit(f"the decode stack ran {steps} of {args.steps} steps: it does not apply to this setup")
    ms = {name: 1e3 * s / steps for name, s in phases.items()}
    stack_ms = sum(ms.values())
    ms["embedding, LM head"] = 1e3 * model_s - stack_ms
    ms["engine (sampler, scheduler, Python)"] = 1e3 * (step_s - model_s)
    return {"batch": batch, "step_ms": 1e3 * step_s, "phase_ms": ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--quantization", default=None, help="a weight method (int8, int4, w8a8, w4a8); default float32")
    p.add_argument("--context", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--settle", type=float, default=2.0, help="seconds between the warm-up and the timed steps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="decode-breakdown-") as tmp:
        model_dir = write_dummy_model_dir(Path(tmp))
        results = [breakdown(model_dir, batch, args) for batch in args.batch_sizes]
    print(env_line(environment()))
    print(f"kernel build {kernel_build()}, weights {args.quantization or 'float32'}, {args.context}-token prompts")
    names = [*STACK_PHASES, "embedding, LM head", "engine (sampler, scheduler, Python)"]
    header = ("phase", *(f"b{r['batch']} ms" for r in results), *(f"b{r['batch']} share" for r in results))
    rows = [
        (name, *(r["phase_ms"][name] for r in results), *(r["phase_ms"][name] / r["step_ms"] for r in results))
        for name in names
    ]
    rows.append(("step", *(r["step_ms"] for r in results), *(1.0 for _ in results)))
    print(format_table(header, rows))
    print(json.dumps({"benchmark": "decode_breakdown", "args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
