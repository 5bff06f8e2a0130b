"""The Triton attention backend against the torch reference backend, on fresh random inputs.

On CUDA the kernels run compiled at full shapes. Without a GPU they run at small shapes in Triton's
CPU interpreter (TRITON_INTERPRET=1: set here before triton is imported, and during each test).
The reference always runs in float32 on the same (dtype-rounded) inputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BLOCK = 16


def _import_kernels():
    """Import the kernels; on CPU with the interpreter on (TRITON_INTERPRET must be set before triton itself
    is imported: its standard library is decorated at import), then leave the environment as it was."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is not installed", allow_module_level=True)
    if CUDA:
        from pagedllm.layers.attention.ops import triton_paged_attention

        return triton_paged_attention
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from pagedllm.layers.attention.ops import triton_paged_attention
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old
    if not triton_paged_attention.interpreting():
        pytest.skip(
            "triton was imported earlier in this process without TRITON_INTERPRET=1, so its kernels "
            "cannot run on CPU here; run this file on its own or with TRITON_INTERPRET=1 set",
            allow_module_level=True,
        )
    return triton_paged_attention


ops = _import_kernels()

from pagedllm.layers.attention import Attention  # noqa: E402
from pagedllm.layers.attention.backends.base import write_kv  # noqa: E402
from pagedllm.layers.attention.backends.torch_sdpa import TorchAttentionBackend  # noqa: E402
from pagedllm.layers.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from pagedllm.layers.attention.metadata import build_common_metadata  # noqa: E402
from pagedllm.layers.attention.selector import get_attn_backend, resolve_backend_name  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    """Triton also reads TRITON_INTERPRET at launch time: keep it on during each CPU test (only)."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def shape(small, full):
    return full if CUDA else small


def _tables(plan, gen):
    """Random, disjoint block tables (block 0 is the null block); returns (tables, num_blocks)."""
    sizes = [math.ceil((c + n) / BLOCK) for c, n in plan]
    num_blocks = sum(sizes) + 4
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, i = [], 0
    for size in sizes:
        tables.append(perm[i : i + size])
        i += size
    return tables, num_blocks


class Pair:
    """The same attention layer on the Triton backend (dtype) and on the torch reference (float32)."""

    def __init__(self, heads, kv_heads, dim, dtype, window, num_blocks, tiles=None):
        scale = 1 / math.sqrt(dim)
        self.dtype = dtype
        self.tri = Attention(heads, dim, kv_heads, scale, sliding_window=window)
        self.ref = Attention(heads, dim, kv_heads, scale, sliding_window=window)
        cache = (2, num_blocks, BLOCK, kv_heads, dim)
        self.tri.bind_kv_cache(torch.zeros(cache, dtype=dtype, device=DEVICE), TritonAttentionBackend(tiles))
        self.ref.bind_kv_cache(torch.zeros(cache, device=DEVICE), TorchAttentionBackend(use_cpu_kernels=False))

    def step(self, query_lens, context_lens, tables, q, k, v):
        md = build_common_metadata(query_lens, context_lens, tables, BLOCK, DEVICE)
        lo = [x.to(DEVICE, self.dtype) for x in (q, k, v)]
        out = self.tri(*lo, self.tri.backend.build_metadata(md))
        expected = self.ref(*[x.float() for x in lo], self.ref.backend.build_metadata(md))
        tol = TOL[self.dtype]
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def run_case(plan, heads, kv_heads, dim, dtype=torch.float32, window=None, tiles=None, seed=0):
    """plan: [(cached context, new tokens)] per request. Step 1 fills the cached prefixes (a prefill-only
    batch), step 2 runs every request's new tokens in one mixed batch; both are compared."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _tables(plan, gen)
    pair = Pair(heads, kv_heads, dim, dtype, window, num_blocks, tiles)
    seqs = [[torch.randn(c + n, h * dim, generator=gen) for h in (heads, kv_heads, kv_heads)] for c, n in plan]
    cached = [i for i, (c, _) in enumerate(plan) if c]
    if cached:
        pair.step(
            [plan[i][0] for i in cached],
            [0] * len(cached),
            [tables[i] for i in cached],
            *[torch.cat([seqs[i][j][: plan[i][0]] for i in cached]) for j in range(3)],
        )
    pair.step(
        [n for _, n in plan],
        [c for c, _ in plan],
        tables,
        *[torch.cat([s[j][c:] for s, (c, _) in zip(seqs, plan)]) for j in range(3)],
    )


# ------------------------------------------------------------------ reshape_and_cache


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_matches_write_kv(dtype):
    gen = torch.Generator().manual_seed(1)
    kv_heads, dim, num_blocks = shape((2, 32, 6), (8, 128, 64))
    num_tokens = shape(21, 700)
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:num_tokens]
    k, v = (torch.randn(num_tokens, kv_heads, dim, generator=gen).to(DEVICE, dtype) for _ in range(2))
    expected = torch.zeros(2, num_blocks, BLOCK, kv_heads, dim, dtype=dtype, device=DEVICE)
    write_kv(expected, k, v, slots.to(DEVICE))
    cache = torch.zeros_like(expected)
    padded = torch.cat([slots, torch.tensor([-1, -1])]).to(DEVICE)  # padding tokens are skipped
    pad = torch.full((2, kv_heads, dim), 7.0, dtype=dtype, device=DEVICE)
    ops.reshape_and_cache(torch.cat([k, pad]), torch.cat([v, pad]), cache[0], cache[1], padded)
    assert torch.equal(cache, expected)


# ------------------------------------------------------------------ attention

# (query heads, KV heads): MHA, 4 query heads per KV head, 3 per KV head (not a power of 2)
GQA = shape([(4, 4), (8, 2), (6, 2)], [(32, 32), (32, 8), (24, 8)])


@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_prefill_only(heads, kv_heads):
    plan = shape([(0, 19), (0, 5), (0, 1), (0, 33)], [(0, 512), (0, 77), (0, 1), (0, 1500)])
    run_case(plan, heads, kv_heads, shape(32, 128))


@pytest.mark.parametrize("window", [None, 7], ids=["full", "window"])
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_decode_only(heads, kv_heads, window):
    gen = torch.Generator().manual_seed(2)
    contexts = shape([17, 40, 3, 0, 16], torch.randint(0, 3000, (96,), generator=gen).tolist())
    window = window and shape(window, 1024)
    run_case([(c, 1) for c in contexts], heads, kv_heads, shape(32, 128), window=window)


def _mixed_plan():
    """Prefill from scratch, chunks on cached prefixes (block-aligned and not), and decodes."""
    return shape(
        [(0, 9), (21, 7), (33, 1), (5, 1), (16, 16)],
        [(0, 300), (700, 256), (2048, 512), (1000, 1)] + [(100 * i + 7, 1) for i in range(40)],
    )


@pytest.mark.parametrize("window", [None, 7], ids=["full", "window"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_batch(dtype, window):
    window = window and shape(window, 500)
    run_case(_mixed_plan(), *shape((8, 2), (32, 8)), shape(32, 128), dtype=dtype, window=window)


@pytest.mark.parametrize("dim", [16, 64, 128, 256])
def test_mixed_batch_head_dims(dim):
    dtype = shape(torch.float32, torch.bfloat16)
    run_case(_mixed_plan(), *shape((4, 2), (32, 8)), dim, dtype=dtype, window=shape(None, 300))


@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_small_tiles_split_requests(heads, kv_heads):
    """Row tiles of 16 and key tiles of 16: each prefill spans several programs (the in-kernel request
    search), and sliding windows start mid-sequence."""
    qpk = heads // kv_heads
    tiles = (16, 16 // qpk, 16)
    plan = shape([(0, 23), (19, 13), (40, 1), (0, 1), (3, 18)], [(0, 400), (900, 130), (40, 1), (0, 1), (3, 18)])
    run_case(plan, heads, kv_heads, 32, window=5, tiles=tiles, seed=3)
    run_case(plan, heads, kv_heads, 32, tiles=tiles, seed=4)


# ------------------------------------------------------------------ selector and flag


def test_selector_defaults_and_override(monkeypatch):
    assert resolve_backend_name("cpu") == "torch"
    assert resolve_backend_name("cpu", "auto") == "torch"
    assert resolve_backend_name("cuda") == "triton"  # triton imports here (the module would be skipped otherwise)
    assert resolve_backend_name("cuda", "torch") == "torch"
    assert get_attn_backend("cpu").name == "torch"
    with pytest.raises(ValueError, match="auto, torch, triton"):
        get_attn_backend("cpu", "flash")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        get_attn_backend("cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_attn_backend("cpu", "triton").name == "triton"


def test_cli_flag():
    from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from_namespace(parser.parse_args([])).attention_backend == "auto"
    assert (
        engine_args_from_namespace(parser.parse_args(["--attention-backend", "triton"])).attention_backend == "triton"
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "flash"])


@pytest.mark.skipif(CUDA, reason="CPU-only: the engine on CUDA is covered by the device session")
def test_engine_greedy_matches_torch_backend(tiny_model_dir, monkeypatch):
    """A tiny model generates the same greedy tokens with the Triton backend (interpreted) as with torch."""
    from pagedllm import LLM, SamplingParams

    model_dir = str(tiny_model_dir("llama"))
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 20, 37)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for name in ("torch", "triton"):
        llm = LLM(model_dir, attention_backend=name, device="cpu")
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["triton"] == outs["torch"]
