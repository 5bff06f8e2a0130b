"""Our Llama / Mistral / Qwen2 / Qwen3 against Hugging Face on tiny random-weight checkpoints.

Each case is saved with ``save_pretrained`` and loaded back through our loader; logits must
match HF's ``model(input_ids).logits`` both for a whole prompt in one step and for a paged,
chunked run (two interleaved requests, block size 4, scattered block tables, decode steps).
"""

import pytest
import torch
import transformers

from pagedllm.demo.tiny import build_tiny_model
from pagedllm.hf_config import load_hf_config, normalize_hf_config
from pagedllm.layers.attention import Attention
from pagedllm.layers.attention.metadata import build_common_metadata
from pagedllm.layers.attention.selector import get_attn_backend
from pagedllm.models.loader import load_model

BLOCK, NUM_BLOCKS = 4, 32
ATOL = RTOL = 1e-4

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
CASES = {
    "llama": dict(arch="llama"),
    "mistral-sliding-sharded": dict(arch="mistral", sliding_window=8, shard_size="40KB"),
    "qwen2-tied": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3"),
    "llama-rope-linear": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-rope-llama3": dict(arch="llama", rope_scaling=LLAMA3),
    "llama-rope-yarn": dict(arch="llama", rope_scaling=YARN),
}

# Two requests served together: per step, how many new tokens each gets (0 = not scheduled).
LEN_A, LEN_B = 28, 22
SCHEDULE = [(9, 12), (8, 8), (7, 1), (1, 1), (1, 0), (1, 0), (1, 0)]
TABLES = ([13, 2, 7, 11, 4, 9, 1], [5, 20, 3, 17, 8, 30])


_LOADED: dict = {}


def load_case(name, tmp_path_factory):
    """(name, checkpoint dir, normalised config, our model, HF model), built once per session."""
    if name not in _LOADED:
        path = build_tiny_model(tmp_path_factory.mktemp(name) / "model", seed=3, **CASES[name])
        config = normalize_hf_config(load_hf_config(path))
        ours = load_model(str(path), config, dtype=torch.float32, device=torch.device("cpu"))
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        _LOADED[name] = (name, path, config, ours, hf)
    return _LOADED[name]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return load_case(request.param, tmp_path_factory)


def bind_caches(model: torch.nn.Module):
    """What the model runner does: one zeroed paged cache per attention layer."""
    backend = get_attn_backend("cpu")
    for module in model.modules():
        if isinstance(module, Attention):
            cache = torch.zeros(2, NUM_BLOCKS, BLOCK, module.num_kv_heads, module.head_dim)
            module.bind_kv_cache(cache, backend)
    return backend


def run_step(model, backend, batch):
    """batch: (token ids of the whole sequence, first new position, number of new tokens, block table)."""
    ids = torch.cat([seq[start : start + n] for seq, start, n, _ in batch])
    positions = torch.cat([torch.arange(start, start + n) for _, start, n, _ in batch])
    common = build_common_metadata(
        [n for _, _, n, _ in batch], [start for _, start, _, _ in batch], [table for *_, table in batch], BLOCK
    )
    with torch.no_grad():
        logits = model.compute_logits(model(ids, positions, backend.build_metadata(common)))
    return logits.split([n for _, _, n, _ in batch])


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids[None]).logits[0]


def prompts(vocab_size):
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab_size, (LEN_A,), generator=gen), torch.randint(0, vocab_size, (LEN_B,), generator=gen)


def test_config_normalised(case):
    name, path, config, _, _ = case
    rope_type = CASES[name].get("rope_scaling", {}).get("rope_type", "default")
    assert config.rope.rope_type == rope_type
    assert config.sliding_windows == ((8, 8) if "sliding" in name else (None, None))
    assert config.tie_word_embeddings == ("tied" in name)
    assert (path / "model.safetensors.index.json").exists() == ("sharded" in name)


def test_full_prompt_matches_hf(case):
    _, _, config, ours, hf = case
    ids, _ = prompts(config.vocab_size)
    backend = bind_caches(ours)
    (logits,) = run_step(ours, backend, [(ids, 0, LEN_A, TABLES[0])])
    assert logits.dtype == torch.float32 and logits.shape == (LEN_A, config.vocab_size)
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def test_chunked_paged_batch_matches_hf(case):
    """Chunked prefill on top of cached prefixes, mixed with decodes of another request."""
    _, _, config, ours, hf = case
    seqs = prompts(config.vocab_size)
    for seq, logits in zip(seqs, run_schedule(ours, seqs)):
        torch.testing.assert_close(logits, hf_logits(hf, seq), atol=ATOL, rtol=RTOL)


def test_sliding_window_matters(tmp_path_factory):
    """Guard for the Mistral case: without the window our logits must diverge from HF's."""
    _, _, config, ours, hf = load_case("mistral-sliding-sharded", tmp_path_factory)
    layers = [m for m in ours.modules() if isinstance(m, Attention)]
    assert [m.sliding_window for m in layers] == [8, 8]
    ids, _ = prompts(config.vocab_size)
    try:
        for m in layers:
            m.sliding_window = None
        (logits,) = run_step(ours, bind_caches(ours), [(ids, 0, LEN_A, TABLES[0])])
    finally:
        for m in layers:
            m.sliding_window = 8
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(logits[:8], ref[:8], atol=ATOL, rtol=RTOL)
    assert (logits[8:] - ref[8:]).abs().max() > 1e-2


def run_schedule(model, seqs):
    """Serve both prompts with SCHEDULE; returns each request's logits for all its positions."""
    backend = bind_caches(model)
    done, outputs = [0, 0], [[], []]
    for counts in SCHEDULE:
        scheduled = [(r, n) for r, n in enumerate(counts) if n]
        batch = [(seqs[r], done[r], n, TABLES[r]) for r, n in scheduled]
        for (r, n), logits in zip(scheduled, run_step(model, backend, batch)):
            outputs[r].append(logits)
            done[r] += n
    assert done == [LEN_A, LEN_B]
    return [torch.cat(out) for out in outputs]


def _tp_worker(rank, world_size, init_file, model_dir, out_file):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        config = normalize_hf_config(load_hf_config(model_dir))
        model = load_model(model_dir, config, dtype=torch.float32, device=torch.device("cpu"))
        assert model.model.embed_tokens.weight.shape[0] == 258  # ceil(515 / 2): really split
        outputs = run_schedule(model, prompts(config.vocab_size))
        if rank == 0:
            torch.save(outputs, out_file)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_matches_hf(tmp_path):
    """TP=2 over gloo: qkv bias, tied embeddings, a vocabulary that does not split evenly, and a
    single KV head replicated on both ranks."""
    import torch.multiprocessing as mp

    path = build_tiny_model(
        tmp_path / "model", "qwen2", seed=5, vocab_size=515, num_kv_heads=1, tie_word_embeddings=True
    )
    out_file = tmp_path / "logits.pt"
    mp.start_processes(
        _tp_worker, args=(2, str(tmp_path / "init"), str(path), str(out_file)), nprocs=2, start_method="spawn"
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for seq, logits in zip(prompts(515), torch.load(out_file)):
        torch.testing.assert_close(logits, hf_logits(hf, seq), atol=ATOL, rtol=RTOL)
