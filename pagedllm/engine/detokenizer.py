"""Incremental detokenization and stop-string matching for one request.

Decoding works the vLLM / HF-TGI way: keep two offsets into the token list. ``prefix_offset``
marks a few tokens of context already emitted (some decoders add or drop a leading space
depending on the neighbours), ``read_offset`` marks where the emitted text ends. Each new
token decodes the short window ``[prefix_offset:]``; its text beyond the context is emitted
unless it ends in U+FFFD, which means the window ends inside a multi-byte character (byte-level
BPE splits emoji and CJK across tokens) and we must wait for the rest of its bytes. So each
token costs two decodes of a window of a handful of tokens, never a decode of the whole output.
"""

from __future__ import annotations

from typing import Any

from pagedllm.sampling_params import SamplingParams

# Prompt tokens used as decoding context for the first output token; a couple extra in case
# some of them are special tokens that decode to nothing.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, a few tokens at a time."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        params: SamplingParams,
        token_texts: TokenTextCache | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        if token_texts is None and tokenizer is not None:
            token_texts = TokenTextCache(tokenizer)
        self._token_texts = token_texts
        self.detokenize = params.detokenize and tokenizer is not None
        self.skip_special_tokens = params.skip_special_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop: list[str] = list(params.stop or []) if self.detokenize else []
        # Chars held back while streaming: they might be the start of a stop string. Not
        # needed when the stop string is kept in the output anyway.
        hold = self.stop and not self.include_stop_str_in_output
        self.stop_buffer_length = max(map(len, self.stop)) - 1 if hold else 0
        self._decode_window = _window_decoder(tokenizer, self.skip_special_tokens)
        self._special_ids = _added_token_texts(tokenizer, params)
        self._last_was_special = False
        self.output_text = ""
        self.num_output_tokens = 0
        self._last_output_text_offset = 0
        self._init_offsets(prompt_token_ids)

    def _init_offsets(self, prompt_token_ids: list[int]) -> None:
        """Start decoding after the prompt's last few tokens, which serve as context only."""
        context = list(prompt_token_ids[-(_CONTEXT_TOKENS + 2) :]) if self.detokenize else []
        self.token_ids: list[int] = context  # decoding context + output ids; windows index this
        self.read_offset = len(context)
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)

    # ------------------------------------------------------------------ decoding
    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add new tokens; return the stop string that ended the request, if one appeared.

        ``stop_terminated``: the engine core already stopped on the last token (EOS or a stop
        token id). Like vLLM, that token's text is left out unless include_stop_str_in_output.
        """
        self.num_output_tokens += len(new_token_ids)
        if not self.detokenize or not new_token_ids:
            return None
        first_index = self.num_output_tokens - len(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        check_from = len(self.output_text)
        for i, token_id in enumerate(new_token_ids, start=first_index + 1):
            self.output_text += self._decode_next(token_id)
            if i <= self.min_tokens:
                # Stop strings only count in text after the first min_tokens tokens.
                check_from = len(self.output_text)
        return self._check_stop(check_from)

    def _decode_next(self, token_id: int) -> str:
        """Decode one more token; return its text, or "" while a character is incomplete."""
        self.token_ids.append(token_id)
        ids = self.token_ids
        prefix_text = self._decode_window(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode_window(ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return self._space_special(token_id, new_text[len(prefix_text) :])

    def _space_special(self, token_id: int, text: str) -> str:
        """spaces_between_special_tokens=False: no decoder-added space between added tokens."""
        if self._special_ids is None:
            return text
        raw = self._special_ids.get(token_id)
        if raw is not None and self._last_was_special:
            text = raw
        self._last_was_special = raw is not None
        return text

    def flush(self) -> None:
        """The request finished: emit bytes still held back as an incomplete character.

        Keeps the final text equal to ``tokenizer.decode(output_ids)`` even when the model
        stopped in the middle of a multi-byte character (it then ends in U+FFFD).
        """
        if not self.detokenize or self.read_offset == len(self.token_ids):
            return
        ids = self.token_ids
        prefix_text = self._decode_window(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode_window(ids[self.prefix_offset :])
        self.output_text += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)

    def decode_token(self, token_id: int) -> str | None:
        """The text of one token on its own (``Logprob.decoded_token``); None without text."""
        if not self.detokenize:
            return None
        assert self._token_texts is not None, "detokenize implies a tokenizer, hence a token text cache"
        return self._token_texts(token_id)

    # ------------------------------------------------------------------ stop strings
    def _check_stop(self, check_from: int) -> str | None:
        """Look for a stop string in the new text (plus a look-back); truncate at a match."""
        if not self.stop or len(self.output_text) == check_from:
            return None
        match = find_stop_string(self.output_text, check_from, self.stop)
        if match is None:
            return None
        stop_str, index = match
        end = index + len(stop_str) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report now; holds back a possible stop-string start until finished."""
        buffer = 0 if finished else self.stop_buffer_length
        end = max(len(self.output_text) - buffer, 0)
        if not delta:
            return self.output_text[:end]
        start = self._last_output_text_offset
        if end <= start:
            return ""
        self._last_output_text_offset = end
        return self.output_text[start:end]


class TokenTextCache:
    """token id -> the token's text on its own, cached per tokenizer.

    Logprobs need the text of k+1 tokens per generated position; the same few thousand
    tokens come up again and again, so one shared cache saves most of the decodes.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


def find_stop_string(text: str, new_from: int, stops: list[str]) -> tuple[str, int] | None:
    """The earliest stop string in ``text`` that ends after ``new_from``, with its index.

    Only a window reaching (len(stop) - 1) chars back before the new text is searched: a
    stop string spanning a token boundary is found, older text is never searched again.
    """
    best: tuple[str, int] | None = None
    for stop in stops:
        index = text.find(stop, max(new_from - len(stop) + 1, 0))
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best


def _window_decoder(tokenizer: Any, skip_special_tokens: bool):
    """A fast ``ids -> str`` for short windows.

    A fast tokenizer's Rust backend is called directly: it skips transformers' per-call
    overhead and its clean_up_tokenization_spaces pass (which would differ between windows
    and the full text; vLLM does not apply it incrementally either).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def _added_token_texts(tokenizer: Any, params: SamplingParams) -> dict[int, str] | None:
    """Added-token texts, needed only when spaces between them must be suppressed."""
    if params.skip_special_tokens or params.spaces_between_special_tokens or tokenizer is None:
        return None
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {token_id: str(added) for token_id, added in decoder.items()} or None
