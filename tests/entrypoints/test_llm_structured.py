"""Constrained decoding through the offline API, on a tiny random-weight model.

Unconstrained, the model writes garbage, so every valid output below is the constraint's doing:
35 JSON schemas x 10 generations (greedy on 4 prompts, 6 seeded samples) in ONE generate call,
all validated with ``jsonschema``; regexes, choices and an arithmetic grammar; unconstrained
requests unaffected by constrained neighbours; preemption and prefix caching; bad constraints
rejected at intake. Every test ends with the block pool intact.
"""

from __future__ import annotations

import collections
import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.structured_output.schemas import SCHEMAS

MAX_TOKENS = 320  # every schema's longest possible output fits (strings are length-bounded, etc.)
GREEDY_PROMPTS = ["Hello world", "Give me JSON:", "The quick brown fox", '{"a": 1}']
NUM_SAMPLED = 6
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
ARITHMETIC = """
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,2}
"""
ARITHMETIC_RE = re.compile(r"^[0-9+\-*/()]+$")


@pytest.fixture(scope="module")
def llm(llama_model_dir) -> LLM:
    return LLM(str(llama_model_dir), max_model_len=512)


@pytest.fixture(autouse=True)
def _pool_intact(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").llm_engine
        assert not engine.has_unfinished_requests()
        engine.check_integrity()


def constrained(
    temperature: float = 0.0, seed: int | None = None, max_tokens: int = MAX_TOKENS, **constraint
) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


# ------------------------------------------------------------------ JSON schemas
def test_every_schema_output_validates_greedy_and_sampled(llm):
    prompts, params, cases = [], [], []
    for name, schema in SCHEMAS:
        for prompt in GREEDY_PROMPTS:
            prompts.append(prompt)
            params.append(constrained(json=schema))
            cases.append((name, schema, "greedy"))
        for i in range(NUM_SAMPLED):
            prompts.append("Answer:")
            params.append(constrained(temperature=1.0, seed=1000 + i, json=schema))
            cases.append((name, schema, f"seed {1000 + i}"))
    assert len(SCHEMAS) >= 30 and len(prompts) >= 300
    outputs = llm.generate(prompts, params, use_tqdm=False)
    failures = []
    for (name, schema, how), output in zip(cases, outputs):
        completion = output.outputs[0]
        try:
            assert completion.finish_reason == "stop", completion.finish_reason
            jsonschema.validate(json.loads(completion.text), schema, format_checker=FORMATS)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name} ({how}): {completion.text!r}: {str(exc)[:200]}")
    assert not failures, f"{len(failures)}/{len(outputs)} invalid:\n" + "\n".join(failures[:10])
    # Sampling explores: the seeded outputs of a schema are not all the same.
    texts = collections.defaultdict(set)
    for (name, _, how), output in zip(cases, outputs):
        if how.startswith("seed"):
            texts[name].add(output.outputs[0].text)
    assert sum(len(t) > 1 for t in texts.values()) >= len(SCHEMAS) // 2


def test_schema_as_json_text_and_ignore_eos(llm):
    schema = dict(SCHEMAS)["two_required"]
    as_dict = llm.generate("x", constrained(json=schema), use_tqdm=False)[0].outputs[0]
    as_text = llm.generate("x", constrained(json=json.dumps(schema)), use_tqdm=False)[0].outputs[0]
    assert as_dict.token_ids == as_text.token_ids
    # ignore_eos: the grammar's end still finishes the request (stop, not length).
    params = constrained(json=schema)
    params.ignore_eos = True
    no_eos = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert no_eos.finish_reason == "stop" and no_eos.token_ids == as_dict.token_ids
    jsonschema.validate(json.loads(no_eos.text), schema)


def test_json_object(llm):
    outputs = llm.generate(GREEDY_PROMPTS, constrained(json_object=True), use_tqdm=False)
    finished = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 2  # any object is allowed, so a random model may write a long one
    for completion in finished:
        assert isinstance(json.loads(completion.text), dict)
    for output in outputs:
        assert output.outputs[0].text.startswith("{")


# ------------------------------------------------------------------ regex, choice, grammar
@pytest.mark.parametrize(
    "pattern",
    [
        r"\d{3}-\d{4}",
        r"(yes|no|maybe)",
        r"[a-z]{2,6}@[a-z]{2,5}\.(com|net)",
        r"#[0-9A-F]{6}",
        r"-?[1-9][0-9]{0,3}(\.[0-9]{1,2})?",
    ],
)
def test_regex(llm, pattern):
    params = [constrained(regex=pattern)] + [constrained(1.0, seed, regex=pattern) for seed in range(5)]
    for output in llm.generate(GREEDY_PROMPTS[:1] * 6, params, use_tqdm=False):
        assert output.outputs[0].finish_reason == "stop"
        assert re.fullmatch(pattern, output.outputs[0].text), output.outputs[0].text


def test_choice(llm):
    choices = ["positive", "negative", "neutral", 'a "quoted" one', "ünïcödé"]
    params = [constrained(choice=choices)] + [constrained(1.0, seed, choice=choices) for seed in range(11)]
    texts = [o.outputs[0].text for o in llm.generate(["How was it?"] * 12, params, use_tqdm=False)]
    assert set(texts) <= set(choices) and len(set(texts)) >= 2


def test_arithmetic_grammar(llm):
    params = [constrained(grammar=ARITHMETIC)] + [constrained(1.0, seed, grammar=ARITHMETIC) for seed in range(15)]
    for output in llm.generate(["Compute:"] * 16, params, use_tqdm=False):
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop" and ARITHMETIC_RE.match(text), text
        assert text.count("(") == text.count(")")
        eval(compile(text, "<expr>", "eval"), {"__builtins__": {}})  # parses as an expression


# ------------------------------------------------------------------ batching
def test_constrained_neighbours_do_not_change_unconstrained_requests(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time", "def main():"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    schema = dict(SCHEMAS)["order"]
    mixed_prompts = [p for prompt in prompts for p in (prompt, "JSON please")]
    mixed_params = [p for _ in prompts for p in (plain, constrained(json=schema))]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == alone
    constrained_alone = llm.generate("JSON please", constrained(json=schema), use_tqdm=False)[0].outputs[0]
    for output in mixed[1::2]:
        assert output.outputs[0].token_ids == constrained_alone.token_ids
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


def test_n_samples_each_follow_the_constraint(llm):
    schema = dict(SCHEMAS)["array_of_objects"]
    params = constrained(1.0, seed=7, json=schema)
    params.n = 4
    output = llm.generate("x", params, use_tqdm=False)[0]
    assert len(output.outputs) == 4
    for completion in output.outputs:
        jsonschema.validate(json.loads(completion.text), schema)


def test_preemption_and_prefix_caching_keep_constrained_outputs(llama_model_dir):
    schema = dict(SCHEMAS)["ref_chain"]
    prefix = "You are a helpful assistant that answers in JSON. " * 4
    prompts = [prefix + f"Request {i}." for i in range(8)]
    params = constrained(json=schema, max_tokens=150)
    roomy = LLM(str(llama_model_dir), max_model_len=256, enable_prefix_caching=False)
    reference = roomy.generate(prompts, params, use_tqdm=False)
    roomy.llm_engine.check_integrity()
    # 20 blocks of 16 tokens (one is the null block): the 8 requests (~8 blocks each) do not fit at once.
    tight = LLM(str(llama_model_dir), max_model_len=256, num_gpu_blocks_override=20)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.engine_core.scheduler.total_preemptions > 0
    assert max(o.num_cached_tokens for o in outputs) >= 32  # the shared prefix was served from the cache
    for ours, ref in zip(outputs, reference):
        assert ours.outputs[0].finish_reason == "stop"
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        jsonschema.validate(json.loads(ours.outputs[0].text), schema)
    tight.llm_engine.check_integrity()


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "constraint, message",
    [
        ({"json": {"type": "strnig"}}, 'invalid JSON schema: Unsupported type "strnig"'),
        (
            {"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}},
            "invalid JSON schema: .*missing",
        ),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"regex": "[a-"}, r"invalid regex: .*position 4: Unclosed '\['"),
        ({"grammar": "root ::= undefined_rule"}, 'invalid grammar: .*Rule "undefined_rule" is not defined'),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ],
)
def test_bad_constraints_fail_at_intake(llm, constraint, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(
            ["ok prompt", "x"],
            [SamplingParams(max_tokens=4), SamplingParams(structured_outputs=constraint)],
            use_tqdm=False,
        )


def test_min_tokens_conflicts_with_a_constraint():
    with pytest.raises(ValueError, match="min_tokens must be 0 when structured_outputs is set"):
        SamplingParams(min_tokens=3, structured_outputs={"regex": "a+"})


def test_compile_time_limit_fails_the_request(llama_model_dir):
    # A limit far below any compile time: a new constraint fails, nothing reaches the engine.
    llm = LLM(str(llama_model_dir), max_model_len=128, structured_outputs_compile_timeout=1e-6)
    with pytest.raises(ValueError, match="did not compile within 1e-06 s"):
        llm.generate("x", constrained(json=dict(SCHEMAS)["order"]), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.check_integrity()
