"""Host staging: zero-copy on CPU; on CUDA one packed (pinned) buffer and one copy per step.

The packing path runs on CPU with ``pack=True, pin=False``; only pinning needs a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.worker.flat_batch import build_flat_batch, flat_batch_arrays
from pagedllm.worker.staging import HostStager

CUDA = torch.cuda.is_available()


def _arrays(n: int = 5) -> dict[str, np.ndarray]:
    return {
        "ids": np.arange(n, dtype=np.int64),
        "table": np.arange(2 * n, dtype=np.int64).reshape(2, n) + 100,
        "empty": np.zeros(0, dtype=np.int64),
        "lens": np.array([7, 9]),
    }


def _assert_same(staged: dict[str, torch.Tensor], arrays: dict[str, np.ndarray]) -> None:
    assert list(staged) == list(arrays)
    for name, a in arrays.items():
        assert staged[name].dtype == torch.int64 and tuple(staged[name].shape) == a.shape
        np.testing.assert_array_equal(staged[name].cpu().numpy(), a)


def test_cpu_default_is_zero_copy():
    arrays = _arrays()
    staged = HostStager("cpu").stage(arrays)
    _assert_same(staged, arrays)
    assert all(np.shares_memory(staged[k].numpy(), a) for k, a in arrays.items() if a.size)


def test_packed_path_one_buffer_reused_and_grown():
    stager = HostStager("cpu", pack=True, pin=False)
    arrays = _arrays()
    staged = stager.stage(arrays)
    _assert_same(staged, arrays)
    # Every tensor is a view of one device allocation (one copy), not of the numpy arrays.
    storages = {t.untyped_storage().data_ptr() for t in staged.values()}
    assert len(storages) == 1 and not np.shares_memory(staged["ids"].numpy(), arrays["ids"])
    base = staged["ids"].data_ptr()
    assert all((t.data_ptr() - base) % 64 == 0 for t in staged.values())  # aligned starts (Triton)
    host = stager._host.data_ptr()
    second = stager.stage(_arrays(3))  # fits: the same host buffer is reused
    assert stager._host.data_ptr() == host
    _assert_same(staged, arrays)  # the earlier step's tensors are not overwritten by the reuse
    _assert_same(second, _arrays(3))
    big = _arrays(5000)  # more than the buffer holds: it grows
    _assert_same(stager.stage(big), big)
    assert stager._host.numel() >= sum(a.size for a in big.values())


def test_packing_converts_dtypes():
    staged = HostStager("cpu", pack=True, pin=False).stage({"a": np.array([1, 2], dtype=np.int32)})
    assert staged["a"].dtype == torch.int64 and staged["a"].tolist() == [1, 2]


def _flat_case():
    tokens = [[5, 6, 7], [8], [9, 10]]
    starts = [0, 20, 3]
    block_ids = [[3], [4, 7], [9]]
    return tokens, starts, block_ids


def test_build_flat_batch_packed_matches_zero_copy():
    tokens, starts, block_ids = _flat_case()
    plain = build_flat_batch(tokens, starts, block_ids, 16, torch.device("cpu"))
    packed = build_flat_batch(
        tokens, starts, block_ids, 16, torch.device("cpu"), stager=HostStager("cpu", pack=True, pin=False)
    )
    for a, b in zip(plain[:2], packed[:2]):
        assert torch.equal(a, b)
    for field in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        assert torch.equal(getattr(plain[2], field), getattr(packed[2], field)), field
    attn = packed[2]
    assert attn.query_start_loc_cpu == [0, 3, 4, 6] and attn.seq_lens_cpu == [3, 21, 5]
    assert attn.max_query_len == 3 and attn.max_seq_len == 21
    assert attn.slot_mapping.tolist() == [48, 49, 50, 7 * 16 + 4, 9 * 16 + 3, 9 * 16 + 4]
    assert attn.block_table.tolist() == [[3, 0], [4, 7], [9, 0]]


def test_flat_batch_arrays_positions():
    arrays = flat_batch_arrays(*_flat_case(), block_size=16)
    assert arrays["positions"].tolist() == [0, 1, 2, 20, 3, 4]
    assert arrays["input_ids"].tolist() == [5, 6, 7, 8, 9, 10]


def test_engine_with_packed_staging_matches(llama_model_dir):
    """A whole generation staged through the packing path gives the same tokens."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(llama_model_dir), max_model_len=64, device="cpu", attention_backend="torch")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 17, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    plain = llm.generate(prompts, params, use_tqdm=False)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    runner.input_batch.stager = HostStager("cpu", pack=True, pin=False)
    packed = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in packed] == [o.outputs[0].token_ids for o in plain]
    assert runner.input_batch.stager._host.numel() > 0


@pytest.mark.skipif(not CUDA, reason="pinned memory and asynchronous copies need CUDA")
def test_cuda_pinned_single_copy():
    stager = HostStager("cuda")
    assert stager.pack and stager.pin
    for n in (5, 3, 5000):
        arrays = _arrays(n)
        staged = stager.stage(arrays)
        assert all(t.is_cuda for t in staged.values()) and stager._host.is_pinned()
        _assert_same(staged, arrays)
