"""llama.cpp baselines through ``llama-cpp-python``'s low-level bindings (``pip install
llama-cpp-python gguf``; it builds llama.cpp from source). Skipped with a message when missing.

The model is the same HF model the HF baseline builds (same seed), written as a GGUF of
``--llama-cpp-type``: float32, or Q8_0 / Q4_0 from ``gguf.quants`` (to set against pagedllm's
``--quantization int8`` / ``w8a8`` / ``int4``; llama.cpp multiplies those with activations
quantized to 8 bits per block of 32).
Sequences are driven with llama.cpp's batch API (``llama_batch`` with one sequence id per slot),
the way ``llama-server -np N`` batches: every step, each running sequence adds one token and
new requests add their whole prompt. Token ids fed back are not sampled (speed does not depend
on their values); only ``llama_decode`` is timed for the latency figures.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.entrypoints.bench.common import BenchModel, is_gguf, read_hf_config
from pagedllm.entrypoints.bench.datasets import BenchRequest

Entry = tuple[int, int, int, bool]  # (token id, position, sequence id, wants logits)
_LOG_CALLBACK: Any = None  # kept alive: llama.cpp holds a pointer to it


def available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("llama_cpp", "gguf"))


def unavailable_reason() -> str:
    missing = [m for m in ("llama_cpp", "gguf") if importlib.util.find_spec(m) is None]
    return (
        f"skipped: {', '.join(missing)} not installed "
        "(pip install llama-cpp-python gguf; llama-cpp-python compiles llama.cpp, a few minutes)"
    )


# --llama-cpp-type -> the GGML type of the matrices (None: float32)
GGUF_TYPES: dict[str, str | None] = {"f32": None, "q8_0": "Q8_0", "q4_0": "Q4_0"}
HEAD_TYPES = ("auto", "f32", "q8_0", "q4_0")


def add_gguf_args(g: Any) -> None:
    """The flags that pick the baseline GGUF's weight types (``bench latency`` and ``throughput``)."""
    g.add_argument(
        "--llama-cpp-type",
        choices=tuple(GGUF_TYPES),
        default="f32",
        help="llama.cpp's weights: f32, or the matrices quantized to q8_0 / q4_0 (compare with pagedllm's "
        "--quantization int8 or w8a8 / int4 on the same shape)",
    )
    g.add_argument(
        "--llama-cpp-head",
        choices=HEAD_TYPES,
        default="auto",
        help="llama.cpp's LM head (the tied embedding matrix): auto = as llama-quantize writes this shape (f32 "
        "in an f32 file, else q8_0: 576 columns are not a multiple of 256 for its Q6_K), as pagedllm's "
        "int8 / int4 / w4a8 hold theirs (int8 groups of 32, Q8_0's rule; w8a8 runs its head as W8A8); f32 = the "
        "work pagedllm does without --quantization",
    )


def gguf_types(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(matrix type, LM head type) as GGML type names (None: float32) from the flags."""
    quant = GGUF_TYPES[args.llama_cpp_type]
    head = args.llama_cpp_head
    if head == "auto":
        return quant, "Q8_0" if quant else None
    return quant, GGUF_TYPES[head]


def weights_label(args: argparse.Namespace) -> str:
    """What the baseline's weights are, for the tables: e.g. ``Q4_0, head Q8_0``."""
    model = getattr(args, "model", None)
    if model is not None and is_gguf(model):
        return "the file's own"
    quant, head = gguf_types(args)
    return f"{quant or 'F32'}, head {head or 'F32'}"


@contextlib.contextmanager
def gguf_for(model: BenchModel, seed: int, args: argparse.Namespace | None = None) -> Iterator[Path]:
    """A temporary GGUF (types from ``args``' llama.cpp flags; float32 without them) of the HF
    model the HF baseline would build with ``seed``; a GGUF model is its own file, as it is."""
    from pagedllm.entrypoints.bench import baselines, gguf_export

    if is_gguf(model.path):
        yield model.path
        return

    quant, head = gguf_types(args) if args is not None else (None, None)
    with tempfile.TemporaryDirectory(prefix="pagedllm-gguf-") as tmp:
        hf = baselines.load_hf_model(model.path, model.dummy, seed)
        path = Path(tmp) / f"model-{(quant or 'f32').lower()}.gguf"
        gguf_export.write_gguf(hf.state_dict(), read_hf_config(model.path), path, quant, head_quant=head)
        del hf
        gc.collect()
        yield path


def _silence(lc: Any) -> None:
    """llama.cpp logs every tensor and graph at load; keep the benchmark's output readable."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = lc.llama_log_callback(lambda level, text, user_data: None)
        lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def extra_buffer_types() -> bool:
    """Whether llama.cpp may repack weights into its extra CPU buffer types. Not where it runs its AMX
    path (built with AMX_INT8, on a CPU with AMX): there llama-cpp-python 0.3.36 built for the
    machine died with a segmentation fault in the first batched llama_decode of a Q4_0 or Q8_0
    model, which would take the whole benchmark with it. Off, it also skips its Q4_0 repacking for
    AVX2 / AVX-512."""
    from pagedllm import cpu_info

    amx_cpu = {"amx_tile", "amx_int8"} <= cpu_info.cpu_features()
    return not (amx_cpu and "AMX_INT8" in build_label().split())


def build_label() -> str:
    """The CPU features llama.cpp was built with (its ``llama_print_system_info``), e.g. "AVX2 FMA
    F16C": with ``PAGEDLLM_CPU_ISA=avx2`` a fair race needs a llama.cpp built for AVX2 too (see
    docs/benchmarks.md), and the note says which one ran."""
    import llama_cpp as lc

    info = lc.llama_print_system_info().decode(errors="replace")
    cpu = info.split("CPU :", 1)[-1]
    on = [name.strip() for name, _, value in (f.partition("=") for f in cpu.split("|")) if value.strip() == "1"]
    isa = [f for f in on if f.startswith(("AVX", "AMX", "FMA", "F16C", "SVE", "NEON", "DOTPROD", "MATMUL"))]
    return " ".join(isa) or "no vector extensions reported"


class LlamaCpp:
    """One llama.cpp model + context with ``n_seq`` parallel sequences."""

    def __init__(self, path: Path, n_seq: int, ctx_per_seq: int, n_batch: int, threads: int | None = None) -> None:
        import llama_cpp as lc
        import torch

        self.lc = lc
        _silence(lc)
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        if not extra_buffer_types():
            model_params.use_extra_bufts = False
        self.model = lc.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        params.n_ctx = n_seq * _round_up(ctx_per_seq, 256)
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads or torch.get_num_threads()
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {n_seq} sequences")
        self.mem = lc.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def decode(self, entries: Sequence[Entry]) -> float:
        """Run one ``llama_decode`` over the entries; returns its wall seconds."""
        if not 0 < len(entries) <= self.n_batch:
            raise ValueError(f"a llama.cpp batch holds 1..{self.n_batch} tokens, got {len(entries)}")
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        start = time.perf_counter()
        rc = self.lc.llama_decode(self.ctx, b)
        self.lc.llama_synchronize(self.ctx)
        elapsed = time.perf_counter() - start
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return elapsed

    def last_logits(self, vocab_size: int, i: int = -1) -> Any:
        """The logits of the batch's ``i``-th token (default: the last; it must have asked for
        logits), a numpy copy."""
        import numpy as np

        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise RuntimeError(f"llama.cpp holds no logits for batch entry {i}")
        return np.ctypeslib.as_array(ptr, shape=(vocab_size,)).copy()

    def clear(self, seq: int = -1) -> None:
        self.lc.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def prompt_entries(prompt: Sequence[int], seq: int) -> list[Entry]:
    return [(t, pos, seq, pos == len(prompt) - 1) for pos, t in enumerate(prompt)]


def decode_in_chunks(llm: LlamaCpp, entries: list[Entry]) -> float:
    return sum(llm.decode(entries[i : i + llm.n_batch]) for i in range(0, len(entries), llm.n_batch))


# ---------------------------------------------------------------------------------------------- latency
@dataclass
class LatencyTimings:
    prefill_s: float
    decode_s: dict[int, float] = field(default_factory=dict)  # batch -> median seconds per step
    note: str = ""


def _prompt(rng_seed: int, length: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(rng_seed)
    return [rng.randrange(10, vocab) for _ in range(length)]


def prefill_latency(path: Path, prompt_len: int, iters: int, vocab: int, seed: int) -> float:
    llm = LlamaCpp(path, 1, prompt_len + 16, max(prompt_len, 512))
    try:
        times = []
        for i in range(iters + 1):
            llm.clear()
            secs = decode_in_chunks(llm, prompt_entries(_prompt(seed + i, prompt_len, vocab), 0))
            times.append(secs)
        return statistics.median(times[1:])
    finally:
        llm.close()


def decode_latency(path: Path, batch: int, args: argparse.Namespace, vocab: int) -> float:
    steps = args.warmup_steps + args.decode_steps
    ctx = args.decode_prompt_len + steps + 8
    llm = LlamaCpp(path, batch, ctx, max(512, batch))
    try:
        entries = [
            e for s in range(batch) for e in prompt_entries(_prompt(args.seed + s, args.decode_prompt_len, vocab), s)
        ]
        decode_in_chunks(llm, entries)
        times = []
        for step in range(steps):
            pos = args.decode_prompt_len + step
            times.append(llm.decode([(100 + s, pos, s, True) for s in range(batch)]))
        return statistics.median(times[args.warmup_steps :])
    finally:
        llm.close()


def latency(path: Path, args: argparse.Namespace, vocab: int) -> LatencyTimings:
    timings = LatencyTimings(prefill_latency(path, args.prefill_len, args.prefill_iters, vocab, args.seed))
    for batch in args.batch_sizes:
        timings.decode_s[batch] = decode_latency(path, batch, args, vocab)
    timings.note = (
        f"{weights_label(args)} GGUF, default KV type (f16), batch API with one sequence per slot; "
        f"only llama_decode is timed; built for {build_label()}"
        + ("" if extra_buffer_types() else "; extra buffer types (AMX, repacked Q4_0) off: its AMX path crashes here")
    )
    return timings


# ---------------------------------------------------------------------------------------------- throughput
@dataclass
class _Slot:
    pos: int
    remaining: int


def _admit(llm: LlamaCpp, queue: deque, active: dict[int, _Slot], slots: int, entries: list[Entry]) -> None:
    """Start queued requests in free slots while their whole prompt fits in this step's batch."""
    free = [s for s in range(slots) if s not in active]
    while queue and free and len(entries) + len(queue[0].prompt_token_ids) <= llm.n_batch:
        request, seq = queue.popleft(), free.pop()
        llm.clear(seq)
        entries += prompt_entries(request.prompt_token_ids, seq)
        active[seq] = _Slot(len(request.prompt_token_ids), request.output_len)


def continuous_batching(path: Path, requests: Sequence[BenchRequest], slots: int) -> float:
    """Wall seconds to serve every request with ``slots`` parallel sequences (each request gets
    exactly its output length: the prefill step yields its first token, each decode step one more)."""
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    n_batch = max(2048, max(len(r.prompt_token_ids) for r in requests) + slots)
    llm = LlamaCpp(path, slots, longest + 8, n_batch)
    try:
        queue = deque(requests)
        active: dict[int, _Slot] = {}
        start = time.perf_counter()
        while queue or active:
            entries: list[Entry] = [(100, st.pos, seq, True) for seq, st in active.items()]
            for st in active.values():
                st.pos += 1
            _admit(llm, queue, active, slots, entries)
            llm.decode(entries)
            for seq in [s for s, st in active.items() if _count_token(st)]:
                del active[seq]
        return time.perf_counter() - start
    finally:
        llm.close()


def _count_token(slot: _Slot) -> bool:
    """One token generated for this slot; True when its request is done."""
    slot.remaining -= 1
    return slot.remaining <= 0
