"""StructuredOutputsParams, the xgrammar backend, the compile service and bitmask application."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import msgspec
import pytest
import torch

from pagedllm.demo.tokenizer import build_tokenizer
from pagedllm.engine.protocol import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.backend import GrammarCompileError, StructuredOutputBackend
from pagedllm.structured_output.bitmask import apply_bitmask_torch, apply_grammar_bitmask
from pagedllm.structured_output.compiler import GrammarCompiler, GrammarTimeoutError
from pagedllm.structured_output.manager import GrammarBitmask
from pagedllm.structured_output.xgrammar_backend import XgrammarBackend, _exact_string_patterns

VOCAB = 576  # the model's vocabulary is larger than the tokenizer's 512 tokens
EOS_IDS = [1, 4]


@pytest.fixture(scope="module")
def backend() -> XgrammarBackend:
    return XgrammarBackend(build_tokenizer(), VOCAB, EOS_IDS)


def accepts(backend: XgrammarBackend, kind: str, spec: str, text: bytes | str) -> bool:
    grammar = backend.new_grammar(backend.compile(kind, spec))
    return grammar.matcher.accept_string(text) and grammar.matcher.is_completed()


# ------------------------------------------------------------------ params
def test_params_round_trip_through_msgspec_and_keep_key_order():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "boolean"}}}
    params = SamplingParams(structured_outputs={"json": schema})
    request = EngineCoreRequest("r", [1, 2], params, 1)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert decoded.sampling_params.structured_outputs == params.structured_outputs
    kind, spec = params.structured_outputs.key()
    assert kind == "json" and list(json.loads(spec)["properties"]) == ["b", "a"]
    assert StructuredOutputsParams(json=json.dumps(schema)).key() == (kind, spec)
    assert StructuredOutputsParams(choice=["x", "y"]).key() == ("choice", '["x", "y"]')


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
        ({"json": {"type": "object"}, "regex": "a"}, r"got \['json', 'regex'\]"),
        ({"json": "[1, "}, "structured_outputs.json is not valid JSON"),
        ({"json": 3}, "structured_outputs.json must be a JSON schema"),
        ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"regex": "  "}, "structured_outputs.regex must be a non-empty string"),
        ({"json_object": False}, "got none"),
    ],
)
def test_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


# ------------------------------------------------------------------ backend
def test_compile_errors_are_clean_and_name_the_kind(backend):
    cases = [
        ("json", '{"type": "strnig"}', 'invalid JSON schema: Unsupported type "strnig"'),
        ("regex", "(ab", "invalid regex: Regex parsing error at position 4: The parenthesis is not closed."),
        ("grammar", 'root ::= "a" |', "invalid grammar: EBNF parser error at line 1, column 15: Expect element"),
    ]
    for kind, spec, message in cases:
        with pytest.raises(GrammarCompileError) as info:
            backend.compile(kind, spec)
        assert str(info.value).startswith(message), str(info.value)
        assert "/project/cpp" not in str(info.value)


def test_choice_escapes_and_json_object(backend):
    spec = json.dumps(['say "hi"', "back\\slash", "new\nline", ""])
    for choice in json.loads(spec):
        assert accepts(backend, "choice", spec, choice)
    assert not accepts(backend, "choice", spec, "say hi")
    assert accepts(backend, "json_object", "", '{"a": [1, {"b": null}]}')
    assert not accepts(backend, "json_object", "", "[1]")


def test_bounded_strings_are_valid_json_with_the_right_length(backend):
    # xgrammar's own maxLength rule admits raw control characters and surrogate byte sequences.
    schema = json.dumps({"type": "string", "maxLength": 3})
    assert set(_exact_string_patterns(json.loads(schema))) == {"type", "pattern"}
    for text, ok in [
        (b'"abc"', True),
        ('"h\u00e9\u4e2d"'.encode(), True),
        ('"\U0001f600"'.encode(), True),
        (b'"abcd"', False),
        (b'"a\x11"', False),
        (b'"a\\"b"', False),
        (b'"\xed\xba\xbc"', False),
        (b'"\xe0\x9f\xaf"', False),
        (b'"\xe4\xb8"', False),
    ]:
        assert accepts(backend, "json", schema, text) == ok, text


@pytest.mark.parametrize(
    "text, ok",
    [
        ("2024-02-29", True),
        ("2000-02-29", True),
        ("1999-12-31", True),
        ("0001-01-01", True),
        ("2023-02-29", False),
        ("1900-02-29", False),
        ("2023-04-31", False),
        ("2023-11-31", False),
        ("2023-02-30", False),
        ("0000-01-01", False),
        ("2023-13-01", False),
        ("2023-1-01", False),
    ],
)
def test_date_format_admits_only_calendar_dates(backend, text, ok):
    # xgrammar's own date rule takes any day 01-31 of any month, and the year 0000.
    schema = json.dumps({"type": "string", "format": "date"})
    assert accepts(backend, "json", schema, f'"{text}"') == ok
    stamp = json.dumps({"type": "string", "format": "date-time"})
    assert accepts(backend, "json", stamp, f'"{text}T23:59:60.5+05:30"') == ok
    assert accepts(backend, "json", stamp, f'"{text}T12:00:00Z"') == ok


def test_tokens_past_the_tokenizer_are_never_allowed(backend):
    grammar = backend.new_grammar(backend.compile("json_object", ""))
    bitmask = backend.allocate_bitmask(1)
    grammar.fill_bitmask(bitmask, 0)
    allowed = _unpack(bitmask)[0]
    assert allowed[:512].any() and not allowed[512:].any()
    assert bitmask.shape == (1, (VOCAB + 31) // 32)


def test_matcher_ends_on_an_end_token(backend):
    grammar = backend.new_grammar(backend.compile("regex", "ab"))
    tokenizer = build_tokenizer()
    for token in tokenizer.encode("ab", add_special_tokens=False):
        assert grammar.accept_token(token)
    bitmask = backend.allocate_bitmask(1)
    grammar.fill_bitmask(bitmask, 0)
    assert _unpack(bitmask)[0].nonzero().flatten().tolist() == EOS_IDS  # only the end tokens are left
    assert not grammar.is_terminated() and grammar.accept_token(EOS_IDS[0]) and grammar.is_terminated()


def test_batched_and_single_fills_agree(backend):
    compiled = backend.compile("json", json.dumps({"type": "array", "items": {"type": "integer"}}))
    grammars = [backend.new_grammar(compiled) for _ in range(20)]
    for i, grammar in enumerate(grammars[:10]):
        grammar.matcher.accept_string("[" + "1, " * i)
    batched, single = backend.allocate_bitmask(20), backend.allocate_bitmask(20)
    backend.fill_bitmasks(grammars, batched)  # >= 16 rows: xgrammar's batch matcher
    for row, grammar in enumerate(grammars):
        grammar.fill_bitmask(single, row)
    assert torch.equal(batched, single)


# ------------------------------------------------------------------ bitmask application
def _unpack(bitmask: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)


@pytest.mark.parametrize("vocab", [100, 128, 49152])
def test_apply_matches_xgrammar_and_reference_for_any_row_order(vocab):
    from xgrammar import apply_token_bitmask_inplace

    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, words), dtype=torch.int32, generator=gen)
    req_ids = ["a", "b", "c", "d", "e"]
    ours = logits.clone()
    apply_grammar_bitmask(ours, GrammarBitmask(["d", "b"], bitmask), req_ids)
    allowed = _unpack(bitmask)[:, :vocab]
    expected = logits.clone()
    expected[3][~allowed[0]] = float("-inf")
    expected[1][~allowed[1]] = float("-inf")
    assert torch.equal(ours, expected)
    reference = logits.clone()
    apply_bitmask_torch(reference, bitmask, [3, 1])
    assert torch.equal(reference, expected)
    full = torch.full((5, words), -1, dtype=torch.int32)
    full[[3, 1]] = bitmask
    kernel = logits.clone()
    apply_token_bitmask_inplace(kernel, full)
    assert torch.equal(kernel, expected)
    all_rows = logits[[3, 1]].clone()
    apply_grammar_bitmask(all_rows, GrammarBitmask(["d", "b"], bitmask), ["d", "b"])
    assert torch.equal(all_rows, expected[[3, 1]])
    unchanged = logits.clone()
    apply_grammar_bitmask(unchanged, None, req_ids)
    assert torch.equal(unchanged, logits)


# ------------------------------------------------------------------ compile service
class SlowBackend(StructuredOutputBackend):
    vocab_size = 64

    def __init__(self) -> None:
        self.release = threading.Event()
        self.compiled: list[tuple[str, str]] = []

    def compile(self, kind: str, spec: str):
        self.release.wait(5)
        self.compiled.append((kind, spec))
        if spec == "bad":
            raise GrammarCompileError(kind, "no good")
        return (kind, spec)

    def new_grammar(self, compiled):  # pragma: no cover - not used here
        raise NotImplementedError

    def allocate_bitmask(self, num_rows: int):  # pragma: no cover
        raise NotImplementedError


def test_compiler_caches_by_constraint_and_bounds_the_time():
    backend = SlowBackend()
    compiler = GrammarCompiler(lambda: backend, timeout_s=0.05)
    params = StructuredOutputsParams(regex="a+")
    first = compiler.submit(params)
    assert compiler.submit(StructuredOutputsParams(regex="a+")) is first  # same constraint, same future
    with pytest.raises(GrammarTimeoutError, match="the regex did not compile within 0.05 s"):
        compiler.check(params)
    backend.release.set()
    compiler.check(params)  # finished meanwhile: cached from now on
    start = time.perf_counter()
    asyncio.run(compiler.acheck(params))
    assert time.perf_counter() - start < 0.05
    with pytest.raises(GrammarCompileError, match="invalid regex: no good"):
        compiler.check(StructuredOutputsParams(regex="bad"))
    with pytest.raises(GrammarCompileError):
        asyncio.run(compiler.acheck(StructuredOutputsParams(regex="bad")))
    assert backend.compiled == [("regex", "a+"), ("regex", "bad")]  # each compiled once
    compiler.shutdown()


def test_acheck_does_not_block_the_event_loop():
    backend = SlowBackend()
    compiler = GrammarCompiler(lambda: backend, timeout_s=5)

    async def main() -> int:
        ticks = 0
        task = asyncio.ensure_future(compiler.acheck(StructuredOutputsParams(regex="x")))
        while not task.done():
            ticks += 1
            if ticks == 5:
                backend.release.set()
            await asyncio.sleep(0.01)
        await task
        return ticks

    assert asyncio.run(main()) >= 5
    compiler.shutdown()
