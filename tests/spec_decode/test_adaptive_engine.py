"""Adaptive speculation end to end: per-request back-off on a real (tiny) model, output unchanged.

The engine's step clock is replaced by a fake device on which each verified proposal costs a
set share of a plain step, so the policy sees the same costs on any machine.
"""

from __future__ import annotations

import random

from pagedllm import LLM, SamplingParams
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.spec_decode.adaptive import MAX_PROBE_INTERVAL

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K}
ALPHABET = list(range(20, 36))


class FakeDevice:
    """Wraps an engine's executor: each step advances a fake clock by 1 plus ``per_draft`` per
    verified proposal; the steps' scheduler outputs are kept in ``steps``."""

    def __init__(self, llm: LLM, per_draft: float) -> None:
        core = llm.llm_engine.engine_core
        assert core.scheduler.spec_policy is not None, "adaptive speculation is on by default"
        core.scheduler.spec_policy.clock = self.clock
        self.now, self.per_draft = 0.0, per_draft
        self.steps: list[SchedulerOutput] = []
        execute = core.executor.execute_model

        def timed(sched: SchedulerOutput):
            self.now += 1.0 + self.per_draft * sum(len(d) for d in sched.scheduled_spec_decode_tokens.values())
            self.steps.append(sched)
            return execute(sched)

        core.executor.execute_model = timed

    def clock(self) -> float:
        return self.now

    def verified(self, req_id: str) -> list[int]:
        """Proposals the request verified at each step it ran."""
        return [
            len(s.scheduled_spec_decode_tokens.get(req_id, ())) for s in self.steps if req_id in s.num_scheduled_tokens
        ]


def _run(llm: LLM, prompts: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    engine = llm.llm_engine
    for req_id, (prompt, params) in prompts.items():
        engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    engine.check_integrity()
    return outputs


def test_low_acceptance_backs_off_while_copying_keeps_speculating(llama_model_dir):
    """Two requests in one batch: random text over 16 tokens (n-grams recur by chance, about one
    proposal in 16 is right) and a repetitive prompt the greedy model keeps copying. A proposal
    costs a quarter of a plain step."""
    llm = LLM(str(llama_model_dir), max_model_len=512, max_num_seqs=4, speculative_config=NGRAM)
    device = FakeDevice(llm, per_draft=0.25)
    rng = random.Random(0)
    low = SamplingParams(temperature=1.0, seed=3, max_tokens=200, ignore_eos=True, allowed_token_ids=ALPHABET)
    copy = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    _run(llm, {"low": (rng.choices(ALPHABET, k=64), low), "copy": ([5, 6, 7, 8] * 6, copy)})
    low_drafts, copy_drafts = device.verified("low"), device.verified("copy")
    assert device.steps[0].spec_token_limits == {}  # both start uncapped
    assert sum(low_drafts[:20]) >= K  # and the random text did speculate at first
    # ... and ended decoding plainly (60 steps of full speculation would verify 240 proposals), but
    # for probes: one accepted by chance (1 in 16) buys a few single proposals until rejections
    # close it again.
    assert sum(low_drafts[-60:]) <= 8
    assert sum(copy_drafts[-30:]) >= 0.8 * 30 * K  # the copying request kept all its proposals


def test_backed_off_requests_are_reprobed(llama_model_dir):
    """With proposals costing nearly a plain step, random text stops speculating; the probes
    that follow come ever rarer but never stop."""
    llm = LLM(str(llama_model_dir), max_model_len=512, max_num_seqs=4, speculative_config=NGRAM)
    device = FakeDevice(llm, per_draft=0.9)
    rng = random.Random(1)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=300, ignore_eos=True, allowed_token_ids=ALPHABET)
    _run(llm, {"a": (rng.choices(ALPHABET, k=64), params)})
    drafts = device.verified("a")
    assert sum(drafts[:20]) >= K  # it speculated at first
    late = drafts[20:]
    assert sum(late) < len(late) / 8 and max(late) <= 2  # then mostly plain: probes, a short run
    assert any(drafts[-2 * MAX_PROBE_INTERVAL :])  # probes keep coming, at most the longest interval apart


def test_greedy_output_unchanged_whatever_the_limits(llama_model_dir):
    """Plain decoding, speculation that backs off on an expensive device, and speculation that
    always proposes k tokens give the same greedy tokens."""
    prompts = {
        "repeat": ([5, 6, 7, 8] * 6, None),
        "count": (list(range(20, 90)), None),
        "pairs": ([3, 4] * 20, None),
        "random": (random.Random(2).choices(range(100, 400), k=40), None),
    }
    greedy = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    cases = {name: (prompt, greedy) for name, (prompt, _) in prompts.items()}
    plain = _run(LLM(str(llama_model_dir), max_model_len=512, max_num_seqs=4), cases)
    adaptive = LLM(str(llama_model_dir), max_model_len=512, max_num_seqs=4, speculative_config=NGRAM)
    device = FakeDevice(adaptive, per_draft=0.5)
    assert _run(adaptive, cases) == plain
    assert any(s.spec_token_limits for s in device.steps)  # some limits really were cut
    fixed = LLM(
        str(llama_model_dir), max_model_len=512, max_num_seqs=4, speculative_config={**NGRAM, "adaptive": False}
    )
    assert fixed.llm_engine.engine_core.scheduler.spec_policy is None
    assert _run(fixed, cases) == plain
