"""Helpers for ``benchmarks/gpu/run_h200.sh`` (one prepared run on the lent H200). Each subcommand is
one short step; none changes the package.

  limits  --json PATH                GPU copy/read bandwidth and bf16 GEMM rate (CUDA events, random
                                     data) + versions; the floors in the summary use these numbers.
  bench   [--eager] -- ARGS...       ``pagedllm bench ARGS`` with pagedllm's INFO log on (memory plan,
                                     graph capture time); ``--eager`` adds ``enforce_eager=True`` to the
                                     engine (the bench CLI has no such flag).
  hf      --model DIR --json PATH    Hugging Face ``generate`` in bf16 on the GPU on the first K of
                                     the same seeded requests as ``bench throughput`` (the bench's own
                                     ``--hf-baseline`` builds an fp32 model on the CPU).
  record  --results PATH --step S --rc N --wall S [--json F] [--log F]
                                     append one step's outcome (+ its JSON report) to a JSONL file.
  summary --results PATH --model-dir DIR [--md PATH]
                                     the compact table: floors from the measured GPU limits, aims, ratios.

Run from the repository root with the repository on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _write_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, default=str) + "\n")


# ---------------------------------------------------------------------------------------------- limits
def _versions() -> dict[str, str]:
    import importlib

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "transformers", "tokenizers", "numpy", "msgspec"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - report, do not fail the step
            out[name] = f"MISSING ({type(exc).__name__}: {exc})"
    return out


def _nvidia_smi() -> str:
    try:
        return subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        return f"nvidia-smi failed: {exc}"


def _event_times(fn: Any, reps: int, warmup: int = 3) -> list[float]:
    """Seconds of each of ``reps`` calls, timed with CUDA events after ``warmup`` untimed calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def cmd_limits(a: argparse.Namespace) -> int:
    import torch

    report: dict[str, Any] = {"date": _now(), "versions": _versions(), "nvidia_smi": _nvidia_smi()}
    if not torch.cuda.is_available():
        report["error"] = "torch.cuda.is_available() is False"
        _write_json(a.json, report)
        print(json.dumps(report, indent=1))
        return 3
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    report.update(
        gpu=props.name, sms=props.multi_processor_count, gpu_mem_gib=props.total_memory / 2**30, cuda=torch.version.cuda
    )
    gen = torch.Generator(dev).manual_seed(0)
    src = torch.randn(a.copy_mib << 18, device=dev, generator=gen)  # fp32: 4 bytes, MiB << 18 elements
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    copy = _event_times(lambda: dst.copy_(src), a.reps)
    read = _event_times(lambda: src.sum(), a.reps)
    src = dst = None  # free before the GEMM buffers
    n = a.gemm_n
    x = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
    y = torch.randn(n, n, device=dev, generator=gen).to(torch.bfloat16)
    mm = _event_times(lambda: torch.mm(x, y), a.reps)
    x = y = None
    torch.cuda.empty_cache()
    report.update(
        copy_bytes_read_plus_written=2 * nbytes,
        copy_gbps_best=2 * nbytes / min(copy) / 1e9,
        copy_gbps_median=2 * nbytes / statistics.median(copy) / 1e9,
        read_gbps_best=nbytes / min(read) / 1e9,
        read_gbps_median=nbytes / statistics.median(read) / 1e9,
        gemm_n=n,
        gemm_tflops_best=2 * n**3 / min(mm) / 1e12,
        gemm_tflops_median=2 * n**3 / statistics.median(mm) / 1e12,
        note="best of the reps is the floor (as pagedllm.entrypoints.bench.machine does); random data",
    )
    _write_json(a.json, report)
    print(f"{report['gpu']} ({report['sms']} SMs, {report['gpu_mem_gib']:.0f} GiB), {report['nvidia_smi']}")
    print(f"versions: {report['versions']}")
    print(
        f"copy {report['copy_gbps_best']:.0f} GB/s (read+write, best; median {report['copy_gbps_median']:.0f}), "
        f"read {report['read_gbps_best']:.0f} GB/s, bf16 GEMM {n}^3 {report['gemm_tflops_best']:.0f} TFLOP/s "
        f"(median {report['gemm_tflops_median']:.0f})"
    )
    return 0


# ---------------------------------------------------------------------------------------------- bench
def cmd_bench(eager: bool, rest: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedllm").setLevel(logging.INFO)
    if eager:
        from pagedllm.entrypoints.bench import common

        original = common.engine_kwargs

        def engine_kwargs(args: argparse.Namespace, model: Any, **overrides: Any) -> dict[str, Any]:
            kwargs = original(args, model, **overrides)
            kwargs["enforce_eager"] = True
            return kwargs

        common.engine_kwargs = engine_kwargs  # latency/throughput look it up on the module at call time
        print("h200_tools: engine built with enforce_eager=True (no CUDA graphs)", flush=True)
    from pagedllm.entrypoints.cli import main

    return main(["bench", *rest])


# ---------------------------------------------------------------------------------------------- hf
def cmd_hf(a: argparse.Namespace) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedllm.entrypoints.bench import baselines, common
    from pagedllm.entrypoints.bench.datasets import random_requests, total_prompt_tokens
    from pagedllm.entrypoints.bench.throughput import SystemResult

    vocab, _ = common.model_limits(Path(a.model))
    requests = random_requests(a.num_requests, tuple(a.prompt_len), tuple(a.output_len), vocab, a.seed)
    report: dict[str, Any] = {"benchmark": "hf-generate", "date": _now(), "args": vars(a), "results": []}
    start = time.perf_counter()
    torch.manual_seed(a.seed)
    config = AutoConfig.from_pretrained(a.model)
    dtype = getattr(torch, a.dtype)
    with torch.device(a.device):  # HF's own random init, directly on the GPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if next(model.parameters()).device.type != torch.device(a.device).type:
        model = model.to(a.device)
    model = model.eval()
    model.generation_config.eos_token_id = None  # as baselines.load_hf_model: nothing stops a request early
    pad = getattr(model.generation_config, "pad_token_id", None)
    model.generation_config.pad_token_id = pad if isinstance(pad, int) else (config.pad_token_id or 0)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    baselines.warm_up(model)
    sync()
    report.update(
        load_and_warmup_s=time.perf_counter() - start,
        dtype=a.dtype,
        attn_implementation=getattr(model.config, "_attn_implementation", None),
        gpu=torch.cuda.get_device_name() if a.device == "cuda" else None,
    )
    _write_json(a.json, report)
    print(f"HF model ready in {report['load_and_warmup_s']:.1f} s ({report['attn_implementation']})", flush=True)

    def add(system: str, sub: list, run: Any, note: str) -> None:
        if len(sub) < len(requests):
            note += f"; SUBSET: first {len(sub)} of {len(requests)} requests"
        result = SystemResult(
            system,
            len(sub),
            total_prompt_tokens(sub),
            run.useful_output_tokens,
            run.generated_tokens,
            run.elapsed_s,
            note,
        )
        report["results"].append(result.to_dict())
        _write_json(a.json, report)  # after every run: a timeout later keeps what finished
        print(
            f"{system}: {len(sub)} requests, {run.useful_output_tokens} useful output tokens in "
            f"{run.elapsed_s:.1f} s = {run.useful_output_tokens / run.elapsed_s:.1f} out tok/s",
            flush=True,
        )

    batched = requests[: a.batch_requests]
    for size in a.batch_sizes if batched else []:
        run = baselines.run_padded_batches(model, batched, size)
        sync()
        add(f"hf-batch-{size}", batched, run, f"{a.dtype}, left-padded batches of {size}, dataset order")
    single = requests[: a.one_at_a_time]
    if single:
        run = baselines.run_one_at_a_time(model, single)
        sync()
        add("hf-one-at-a-time", single, run, f"{a.dtype}, batch size 1")
    return 0


# ---------------------------------------------------------------------------------------------- record
_LOG_KEYS = (
    "captured CUDA graphs",
    "GPU memory:",
    "engine ready",
    "start-up",
    "Error",
    "error:",
    "Traceback",
    "passed",
    "failed",
    "skipped",
    "SKIPPED",
    "enforce_eager",
)


def cmd_record(a: argparse.Namespace) -> int:
    entry: dict[str, Any] = {
        "step": a.step,
        "rc": a.rc,
        "wall_s": a.wall,
        "timed_out": a.rc in (124, 137),
        "time": _now(),
    }
    if a.json and Path(a.json).is_file():
        text = Path(a.json).read_text().strip()
        try:
            entry["report"] = json.loads(text.splitlines()[-1]) if text else None
        except json.JSONDecodeError as exc:
            entry["report_error"] = str(exc)
    if a.log and Path(a.log).is_file():
        lines = Path(a.log).read_text(errors="replace").splitlines()
        entry["log_lines"] = [ln for ln in lines if any(k in ln for k in _LOG_KEYS)][-25:]
        if a.rc != 0:
            entry["log_tail"] = lines[-30:]
    with open(a.results, "a") as f:
        f.write(json.dumps(entry, default=str) + "\n")
    return 0


# ---------------------------------------------------------------------------------------------- summary
def _load(results: Path) -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    if results.is_file():
        for line in results.read_text().splitlines():
            if line.strip():
                e = json.loads(line)
                entries[e["step"]] = e  # the latest of each step
    return entries


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c) if not isinstance(c, str) else c for c in r) + " |" for r in rows]
    return out


def _latency_rows(report: dict[str, Any] | None, copy_bps: float, gemm_fps: float) -> dict[tuple[str, int], Any]:
    rows = {}
    for m in (report or {}).get("results", []):
        if m["system"] != "pagedllm":
            continue
        floor = max(m["bytes"] / copy_bps, m["flops"] / gemm_fps) if copy_bps and gemm_fps else None
        rows[(m["figure"], m["batch"])] = dict(m, gpu_floor_s=floor)
    return rows


def cmd_summary(a: argparse.Namespace) -> int:
    entries = _load(Path(a.results))
    out: list[str] = []
    lim = (entries.get("limits") or {}).get("report") or {}
    copy_bps = (lim.get("copy_gbps_best") or 0) * 1e9
    gemm_fps = (lim.get("gemm_tflops_best") or 0) * 1e12
    out.append(
        f"## CUDA: Llama-3-8B shape, bf16, one {lim.get('gpu', 'GPU?')} "
        f"(`benchmarks/gpu/run_h200.sh`) — {str(lim.get('date', _now()))[:10]}"
    )
    out.append("")
    vers = lim.get("versions", {})
    out.append(
        f"Device: {lim.get('gpu', '?')}, {lim.get('sms', '?')} SMs, {_fmt(lim.get('gpu_mem_gib'), 0)} GiB "
        f"(nvidia-smi: {lim.get('nvidia_smi', '?')}); torch {vers.get('torch', '?')} (CUDA "
        f"{lim.get('cuda', '?')}), triton {vers.get('triton', '?')}, transformers "
        f"{vers.get('transformers', '?')}, Python {vers.get('python', '?')}."
    )
    out.append(
        f"Measured in the same run (CUDA events, random data, best of reps): copy "
        f"{_fmt(lim.get('copy_gbps_best'), 0)} GB/s (read + write), read {_fmt(lim.get('read_gbps_best'), 0)}"
        f" GB/s, bf16 GEMM {lim.get('gemm_n', '?')}^3 {_fmt(lim.get('gemm_tflops_best'), 0)} TFLOP/s. "
        "Floors below use these (the bench's own floors are measured on the CPU and are ignored)."
    )
    out.append("")
    out.append("Steps:")
    out += _table(
        ["step", "rc", "wall s", "note"],
        [
            [k, e["rc"], e["wall_s"], "TIMED OUT" if e.get("timed_out") else ("skipped" if e["rc"] == -1 else "")]
            for k, e in entries.items()
        ],
    )
    tests = [(k, e) for k, e in entries.items() if k.startswith("pytest")]
    if tests:
        out.append("")
    for name, e in tests:
        tail = [ln for ln in e.get("log_lines", []) if " passed" in ln or " failed" in ln or " error" in ln]
        out.append(f"Tests at full shapes, {name}: rc {e['rc']}; {tail[-1].strip() if tail else 'no summary line'}")

    # ---- latency
    lat = _latency_rows((entries.get("latency") or {}).get("report"), copy_bps, gemm_fps)
    eag = _latency_rows((entries.get("latency_eager") or {}).get("report"), copy_bps, gemm_fps)
    aims: list[str] = []
    if lat:
        out.append("")
        out.append("Step latency (`pagedllm bench latency`, CUDA graphs on):")
        rows = []
        for (fig, batch), m in sorted(lat.items(), key=lambda kv: (kv[0][0] != "prefill", kv[0][1])):
            floor = m["gpu_floor_s"]
            ovh = m.get("engine_overhead")
            rows.append(
                [
                    f"prefill {m['tokens']}" if fig == "prefill" else f"decode, batch {batch}",
                    f"{m['seconds'] * 1e3:.2f}",
                    m["tokens_per_s"],
                    f"{m['bytes'] / 1e9:.2f}",
                    f"{m['flops'] / 1e12:.2f}",
                    "-" if floor is None else f"{floor * 1e3:.2f}",
                    "-" if floor is None else f"{m['seconds'] / floor:.2f}x",
                    "-" if ovh is None else f"{100 * ovh:.1f}%",
                ]
            )
        out += _table(
            ["figure", "ms", "tok/s", "GB moved (model)", "TFLOP", "floor ms", "measured / floor", "overhead"], rows
        )
        b1, b128 = lat.get(("decode", 1)), lat.get(("decode", 128))
        if b1 and b1["gpu_floor_s"]:
            r = b1["seconds"] / b1["gpu_floor_s"]
            aims.append(f"decode batch 1 at {r:.2f}x the bytes floor (aim <= 1.3x): {'MET' if r <= 1.3 else 'MISSED'}")
        if b128:
            t = b128["tokens_per_s"]
            aims.append(f"decode batch 128 at {t:,.0f} output tok/s (aim > 5,000): {'MET' if t > 5000 else 'MISSED'}")
    if lat and eag:
        out.append("")
        out.append("CUDA graphs vs `enforce_eager` (same decode batches, separate engine):")
        rows = []
        for (fig, batch), e in sorted(eag.items()):
            g = lat.get((fig, batch))
            if fig != "decode" or g is None:
                continue
            rows.append(
                [
                    f"decode, batch {batch}",
                    f"{g['seconds'] * 1e3:.2f}",
                    f"{e['seconds'] * 1e3:.2f}",
                    f"{e['seconds'] / g['seconds']:.2f}x",
                ]
            )
        out += _table(["figure", "graphs ms", "eager ms", "graphs speed-up"], rows)

    # ---- throughput
    thr = (entries.get("throughput") or {}).get("report")
    hf = (entries.get("hf") or {}).get("report")
    if thr or hf:
        out.append("")
        out.append(
            "Offline throughput (`pagedllm bench throughput`; HF `generate` bf16 on the same GPU, same requests):"
        )
        results = list((thr or {}).get("results", [])) + list((hf or {}).get("results", []))
        paged = next((r for r in results if r["system"] == "pagedllm"), None)
        rows = []
        for r in results:
            ratio = paged["output_tokens_per_s"] / r["output_tokens_per_s"] if paged and r is not paged else None
            rows.append(
                [
                    r["system"],
                    r["requests"],
                    r["prompt_tokens"],
                    r["output_tokens"],
                    r["elapsed_s"],
                    r["output_tokens_per_s"],
                    r["total_tokens_per_s"],
                    None if ratio is None else f"{ratio:.2f}x",
                ]
            )
        floor = _workload_floor(thr, a.model_dir, copy_bps, gemm_fps) if thr else None
        if floor and paged:
            rows.append(
                [
                    "floor (all at once, GPU limits; pagedllm's share of it)",
                    paged["requests"],
                    paged["prompt_tokens"],
                    paged["output_tokens"],
                    floor,
                    paged["output_tokens"] / floor,
                    None,
                    f"{paged['output_tokens_per_s'] / (paged['output_tokens'] / floor):.2f}x",
                ]
            )
        out += _table(
            ["system", "reqs", "prompt tok", "output tok", "wall s", "out tok/s", "total tok/s", "pagedllm is"], rows
        )
        if thr:
            out.append(
                f"pagedllm start-up (load, profile, graph capture, warm-up; not timed above): "
                f"{_fmt(thr.get('pagedllm_startup_s'))} s"
            )
        hf_rates = [r["output_tokens_per_s"] for r in results if r["system"].startswith("hf")]
        if paged and hf_rates:
            best = max(hf_rates)
            aims.append(f"throughput {paged['output_tokens_per_s'] / best:.2f}x the best HF row (aim: several times)")
    logs = [
        ln
        for k in ("latency", "throughput", "latency_eager")
        for ln in (entries.get(k) or {}).get("log_lines", [])
        if "captured CUDA graphs" in ln or "GPU memory:" in ln or "engine ready" in ln
    ]
    if logs:
        out.append("")
        out.append("Engine start-up lines (latency, throughput, eager):")
        out += [f"    {ln.strip()[:220]}" for ln in logs]
    if aims:
        out.append("")
        out.append("Aims (issue 7):")
        out += [f"- {s}" for s in aims]
    text = "\n".join(out) + "\n"
    print(text)
    if a.md:
        Path(a.md).write_text(text)
    return 0


def _workload_floor(thr: dict[str, Any], model_dir: str | None, copy_bps: float, gemm_fps: float) -> float | None:
    """machine.workload_floor_seconds on the same seeded requests, with the GPU limits."""
    if not model_dir or not copy_bps or not gemm_fps:
        return None
    try:
        from pagedllm.entrypoints.bench import common, machine
        from pagedllm.entrypoints.bench.datasets import random_requests

        args = thr["args"]
        vocab, _ = common.model_limits(Path(model_dir))
        reqs = random_requests(
            args["num_requests"], tuple(args["prompt_len"]), tuple(args["output_len"]), vocab, args["seed"]
        )
        cost = machine.model_cost(common.read_hf_config(Path(model_dir)), args["dtype"])
        limits = machine.MachineLimits(
            copy_gbps=copy_bps / 1e9, read_gbps=copy_bps / 1e9, gemm_gflops=gemm_fps / 1e9, bandwidth="copy"
        )
        return machine.workload_floor_seconds(
            cost, limits, [len(r.prompt_token_ids) for r in reqs], [r.output_len for r in reqs]
        )
    except Exception as exc:  # noqa: BLE001 - the summary must print regardless
        print(f"(workload floor not computed: {exc})")
        return None


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        rest = argv[1:]
        eager = bool(rest) and rest[0] == "--eager"
        rest = rest[1:] if eager else rest
        if rest and rest[0] == "--":
            rest = rest[1:]
        return cmd_bench(eager, rest)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("limits")
    s.add_argument("--json", required=True)
    s.add_argument("--copy-mib", type=int, default=2048, help="fp32 source buffer (and as much again for the copy)")
    s.add_argument("--gemm-n", type=int, default=8192)
    s.add_argument("--reps", type=int, default=10)
    s = sub.add_parser("hf")
    s.add_argument("--model", required=True)
    s.add_argument("--json", required=True)
    s.add_argument("--num-requests", type=int, default=1000)
    s.add_argument("--prompt-len", type=int, nargs=2, default=[128, 1024])
    s.add_argument("--output-len", type=int, nargs=2, default=[128, 512])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--one-at-a-time", type=int, default=4, metavar="K", help="first K requests at batch size 1")
    s.add_argument("--batch-requests", type=int, default=128, metavar="K", help="first K requests in padded batches")
    s.add_argument("--batch-sizes", type=int, nargs="+", default=[64])
    s.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    s.add_argument("--device", default="cuda", help="cuda (cpu only for a smoke test of this script)")
    s = sub.add_parser("record")
    s.add_argument("--results", required=True)
    s.add_argument("--step", required=True)
    s.add_argument("--rc", type=int, required=True)
    s.add_argument("--wall", type=int, required=True)
    s.add_argument("--json", default=None)
    s.add_argument("--log", default=None)
    s = sub.add_parser("summary")
    s.add_argument("--results", required=True)
    s.add_argument("--model-dir", default=None)
    s.add_argument("--md", default=None)
    a = p.parse_args(argv)
    return {"limits": cmd_limits, "hf": cmd_hf, "record": cmd_record, "summary": cmd_summary}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
