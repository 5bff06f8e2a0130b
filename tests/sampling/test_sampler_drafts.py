"""One sampling chain for every caller: the plain sample, a draft model's draw (Sampler.draw) and
the verification of proposals (Sampler.sample with drafts) share one definition of greedy."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sampling import DraftBatch, Sampler, SamplingMetadata
from pagedllm.sampling_params import SAMPLING_EPS, SamplingParams

N, V = 200, 50


def _md(params: list[SamplingParams], generators=None) -> SamplingMetadata:
    return SamplingMetadata.from_params(params, [[] for _ in params], [[] for _ in params], V, generators=generators)


@pytest.mark.parametrize("scale, greedy", [(0.99, True), (1.01, False)])
def test_a_temperature_at_the_threshold_is_treated_alike_everywhere(scale, greedy):
    """Flat logits: a greedy row always takes token 0 (the first argmax), a random one spreads."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=SAMPLING_EPS * scale)
    assert params.sampling_type_greedy == greedy  # SamplingParams' normalisation uses the same threshold
    sampler, logits = Sampler(), torch.zeros(N, V)
    md = _md([params] * N)
    assert md.greedy == [greedy] * N and md.all_greedy == greedy

    plain = [t for [t] in sampler.sample(logits, md).token_ids]
    drawn, probs = sampler.draw(logits, md, keep_probs=True)  # the draft model's path
    drafts = DraftBatch([1] * N, torch.full((N,), 5, dtype=torch.int64), None)
    verified = sampler.sample(torch.zeros(2 * N, V), md.select([i // 2 for i in range(2 * N)]), drafts).token_ids

    if greedy:
        assert plain == drawn.tolist() == [0] * N and probs is None
        assert verified == [[0]] * N  # proposal 5 is not the argmax: rejected, the argmax emitted
    else:
        assert len(set(plain)) > 10 and len(set(drawn.tolist())) > 10 and probs is not None
        assert len({tuple(t) for t in verified}) > 10


def test_draw_keeping_the_distribution_draws_the_same_tokens():
    """A draft model keeps what it drew from (keep_probs): the draw itself must not change."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.8, top_k=10, seed=3), SamplingParams(temperature=0.0)] * 3

    def tokens(keep_probs: bool) -> tuple[list[int], torch.Tensor | None]:
        gens = {i: torch.Generator().manual_seed(i) for i in range(6)}
        drawn, probs = Sampler().draw(logits, _md(params, gens), keep_probs=keep_probs)
        return drawn.tolist(), probs

    (kept, probs), (plain, none) = tokens(True), tokens(False)
    assert kept == plain and none is None
    assert probs.shape == (6, V) and torch.allclose(probs.sum(-1), torch.ones(6))
    assert (probs[0] > 0).sum() == 10  # the processed distribution: top-k applied


def test_verify_keeps_the_greedy_prefix_and_scores_emitted_tokens():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(2))
    best = logits.argmax(-1).tolist()
    wrong = (best[2] + 1) % V
    # Request 0: rows 0-3, proposals [best of row 0, best of row 1, wrong]; request 1: row 4, none.
    drafts = DraftBatch([3, 0], torch.tensor([best[0], best[1], wrong]), None)
    params = [SamplingParams(temperature=0.0, logprobs=2)] * 2
    md = _md(params).select([0, 0, 0, 0, 1])
    out = Sampler().sample(logits, md, drafts)
    assert out.token_ids == [[best[0], best[1], best[2]], [best[4]]]
    assert out.sampled_token_ids is None
    scored = out.logprobs_tensors.logprob_token_ids[:, 0].tolist()
    assert scored[:3] + scored[4:] == [best[0], best[1], best[2], best[4]]  # row 3 is past the emitted end
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs_tensors.logprobs[:, 0], raw.gather(1, torch.tensor(scored)[:, None])[:, 0])
