"""StructuredOutputManager: the engine core's side of constrained decoding.

It starts each constrained request's compile (off the step loop), and each step fills one
bitmask row per constrained request that samples, for the model runner to apply to the logits.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from dataclasses import dataclass
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.request import Request, RequestStatus
from pagedllm.structured_output.compiler import GrammarCompiler
from pagedllm.structured_output.request import StructuredOutputRequest

logger = logging.getLogger(__name__)


@dataclass
class GrammarBitmask:
    """Allowed next tokens of the constrained requests sampled this step: row i is ``req_ids[i]``.

    ``bitmask`` is an int32 [len(req_ids), ceil(vocab / 32)] CPU tensor (bit set = allowed), a
    view of a buffer the manager reuses: valid until the next step's bitmask is built.
    """

    req_ids: list[str]
    bitmask: Any


class StructuredOutputManager:
    def __init__(self, config: EngineConfig, compiler: GrammarCompiler | None = None) -> None:
        self.compiler = compiler if compiler is not None else make_grammar_compiler(config)
        self.timeout_s = self.compiler.timeout_s
        self.max_rows = config.scheduler_config.max_num_seqs
        self._bitmask: Any = None

    def grammar_init(self, request: Request) -> None:
        """Start compiling (or reuse) the request's grammar; it waits until that is done."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        future = self.compiler.submit(params)
        request.structured_output = StructuredOutputRequest(
            params, future, lambda compiled: self.compiler.backend().new_grammar(compiled), self.timeout_s
        )
        request.status = RequestStatus.WAITING_FOR_FSM

    def grammar_bitmask(self, req_ids: list[str], requests: dict[str, Request]) -> GrammarBitmask | None:
        """Bitmask rows for ``req_ids`` (constrained requests that sample this step)."""
        if not req_ids:
            return None
        backend = self.compiler.backend()
        if self._bitmask is None:
            self._bitmask = backend.allocate_bitmask(self.max_rows)
        bitmask = self._bitmask[: len(req_ids)]
        backend.fill_bitmasks([requests[r].structured_output.grammar for r in req_ids], bitmask)
        return GrammarBitmask(req_ids, bitmask)

    @staticmethod
    def wait_for_compiles(requests: list[Request], timeout_s: float) -> None:
        """Sleep until one of these requests' grammars is done (or ``timeout_s`` passes): what
        the step loop does instead of spinning when compiling requests are all it has."""
        futures = [r.structured_output.future for r in requests if r.structured_output is not None]
        if futures:
            cf.wait(futures, timeout=timeout_s, return_when=cf.FIRST_COMPLETED)

    def shutdown(self) -> None:
        self.compiler.shutdown()


def make_grammar_compiler(config: EngineConfig, tokenizer: Any = None) -> GrammarCompiler:
    """A compiler for this model's tokenizer and vocabulary (the tokenizer is loaded lazily,
    in a compile thread, when none is given)."""
    so_config = config.structured_outputs_config

    def make_backend():
        from pagedllm.engine.tokenizer import generation_eos_token_ids, load_tokenizer

        mc = config.model_config
        tok = tokenizer if tokenizer is not None else load_tokenizer(mc.tokenizer, mc.trust_remote_code)
        stops = set(generation_eos_token_ids(mc.model)) | set(mc.arch.eos_token_ids or ())
        if tok.eos_token_id is not None:
            stops.add(tok.eos_token_id)
        return _create_backend(so_config.backend, tok, mc.arch.vocab_size, sorted(stops))

    return GrammarCompiler(make_backend, so_config.compile_timeout_s)


def _create_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
    if name == "xgrammar":
        try:
            from pagedllm.structured_output.xgrammar_backend import XgrammarBackend
        except ImportError as exc:
            raise RuntimeError(f"structured outputs need the xgrammar package ({exc}); pip install xgrammar") from exc
        return XgrammarBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"unknown structured outputs backend {name!r}; use 'xgrammar'")
