"""The parallel layers' shard math at tp=2, without processes: rank 0's and rank 1's layers are
built under a simulated group (collectives left to the test), each loads the full checkpoint
tensor through its weight_loader, and the ranks' outputs, concatenated or summed as the real
collective would, must equal the unsharded layer's."""

import contextlib

import pytest
import torch

from pagedllm.distributed import parallel_state
from pagedllm.distributed.parallel_state import TPGroup, get_tp_group
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding, VocabShard
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


class LocalShard(TPGroup):
    """Rank ``rank`` of ``size`` whose collectives return this rank's part: the test combines them."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x


@contextlib.contextmanager
def tp_rank(rank: int, size: int):
    parallel_state.set_tp_group(LocalShard(rank, size))
    try:
        yield
    finally:
        parallel_state.set_tp_group(None)


def build_ranks(make, size=2):
    """(the unsharded layer, [rank 0's layer, rank 1's layer, ...])."""
    layers = []
    for rank in range(size):
        with tp_rank(rank, size):
            layers.append(make())
    return make(), layers


def load(layer, name, tensor, shard_id=None):
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


def test_group_defaults_to_one_rank_and_is_restored():
    assert get_tp_group() == TPGroup(0, 1)
    with tp_rank(1, 2):
        assert (get_tp_group().rank, get_tp_group().size) == (1, 2)
        assert ColumnParallelLinear(4, 8).tp.rank == 1
    assert get_tp_group().size == 1


def test_column_parallel_concatenates_to_the_full_output():
    w, b, x = torch.randn(12, 5), torch.randn(12), torch.randn(3, 5)
    full, ranks = build_ranks(lambda: ColumnParallelLinear(5, 12, bias=True))
    for layer in (full, *ranks):
        load(layer, "weight", w)
        load(layer, "bias", b)
    assert ranks[0].weight.shape == (6, 5)
    torch.testing.assert_close(torch.cat([r(x) for r in ranks], dim=-1), full(x))


def test_row_parallel_sums_to_the_full_output_with_the_bias_once():
    w, b, x = torch.randn(7, 10), torch.randn(7), torch.randn(3, 10)
    full, ranks = build_ranks(lambda: RowParallelLinear(10, 7, bias=True))
    for layer in (full, *ranks):
        load(layer, "weight", w)
        load(layer, "bias", b)
    assert ranks[1].weight.shape == (7, 5)
    parts = [r(x[:, 5 * i : 5 * (i + 1)]) for i, r in enumerate(ranks)]  # the previous layer's split
    torch.testing.assert_close(sum(parts), full(x))


def test_merged_column_keeps_each_projection_split():
    gate, up, x = torch.randn(8, 6), torch.randn(8, 6), torch.randn(2, 6)
    full, ranks = build_ranks(lambda: MergedColumnParallelLinear(6, [8, 8]))
    for layer in (full, *ranks):
        load(layer, "weight", gate, 0)
        load(layer, "weight", up, 1)
    outs = [r(x).split(4, dim=-1) for r in ranks]  # each rank: [its gate | its up]
    gathered = torch.cat([torch.cat([o[0] for o in outs], -1), torch.cat([o[1] for o in outs], -1)], -1)
    torch.testing.assert_close(gathered, full(x))


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["split-kv", "replicated-kv"])
def test_qkv_splits_heads_and_replicates_scarce_kv_heads(kv_heads):
    heads, dim, hidden = 4, 3, 8
    q, k, v = torch.randn(heads * dim, hidden), torch.randn(kv_heads * dim, hidden), torch.randn(kv_heads * dim, hidden)
    bias = {s: torch.randn(t.shape[0]) for s, t in zip("qkv", (q, k, v))}
    x = torch.randn(5, hidden)
    full, ranks = build_ranks(lambda: QKVParallelLinear(hidden, dim, heads, kv_heads, bias=True))
    for layer in (full, *ranks):
        for shard, tensor in zip("qkv", (q, k, v)):
            load(layer, "weight", tensor, shard)
            load(layer, "bias", bias[shard], shard)
    assert [(r.num_heads, r.num_kv_heads) for r in ranks] == [(2, 1), (2, 1)]
    want_q, want_k, want_v = full(x).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    parts = [r(x).split([2 * dim, dim, dim], dim=-1) for r in ranks]
    torch.testing.assert_close(torch.cat([p[0] for p in parts], -1), want_q)
    for i, want in ((1, want_k), (2, want_v)):
        if kv_heads == 2:
            torch.testing.assert_close(torch.cat([p[i] for p in parts], -1), want)
        else:  # both ranks hold the one KV head
            for p in parts:
                torch.testing.assert_close(p[i], want)


def test_vocab_parallel_embedding_pads_the_last_shard():
    table, ids = torch.randn(515, 4), torch.tensor([0, 257, 258, 514, 3])
    full, ranks = build_ranks(lambda: VocabParallelEmbedding(515, 4))
    for layer in (full, *ranks):
        load(layer, "weight", table)
    assert [r.shard for r in ranks] == [VocabShard(0, 258, 258), VocabShard(258, 515, 258)]
    assert ranks[1].weight.shape == (258, 4) and not ranks[1].weight[257].any()  # the padding row
    torch.testing.assert_close(sum(r(ids) for r in ranks), full(ids))  # the all-reduce's sum


@pytest.mark.parametrize("processed", [False, True], ids=["checkpoint-layout", "gemm-layout"])
def test_lm_head_gathers_the_vocabulary(processed):
    table, hidden = torch.randn(515, 16), torch.randn(3, 16)
    full, ranks = build_ranks(lambda: ParallelLMHead(515, 16))
    for layer in (full, *ranks):
        load(layer, "weight", table)
        if processed:
            layer.quant_method.process_weights_after_loading(layer)
    gathered = torch.cat([r(hidden) for r in ranks], dim=-1)[..., :515]
    torch.testing.assert_close(gathered, full(hidden), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full(hidden), hidden @ table.T, rtol=1e-5, atol=1e-5)


def test_tied_head_shares_the_embedding_shard():
    with tp_rank(1, 2):
        embed, head = VocabParallelEmbedding(515, 16), ParallelLMHead(515, 16)
        head.tie_weights(embed)
    table = torch.randn(515, 16)
    load(embed, "weight", table)
    torch.testing.assert_close(head(torch.eye(16))[:, :257], table[258:].T)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: ColumnParallelLinear(4, 6), "output size"),
        (lambda: RowParallelLinear(6, 4), "input size"),
        (lambda: QKVParallelLinear(8, 2, 6, 2), "num_attention_heads"),
        (lambda: QKVParallelLinear(8, 2, 8, 3), "num_key_value_heads"),
    ],
)
def test_sizes_that_do_not_split_are_value_errors(make, match):
    with tp_rank(0, 4), pytest.raises(ValueError, match=match):
        make()
