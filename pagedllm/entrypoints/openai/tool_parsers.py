"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser``): find the calls a model
wrote in its own format. Streaming holds back text that may start a call and sends each call
once it is complete (its arguments in one delta).

- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, any text before them is the content.
- ``llama3_json`` (Llama 3.x): the whole output is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several separated by ``;``.
"""

from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.tool_calls import ToolCallExtractor, tool_call


def _call_from_json(text: str) -> dict | None:
    """One call from ``{"name": ..., "arguments"|"parameters": {...}}``; None if it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return tool_call(obj["name"], arguments)


def _partial_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class HermesToolParser(ToolCallExtractor):
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.inside = False

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        found = [_call_from_json(block.strip()) for block in self._BLOCK.findall(text)]
        calls = [c for c in found if c is not None]
        if not calls or len(calls) < len(found):
            return text, []  # not well-formed: leave the text as it is
        self.num_calls = len(calls)
        return text[:start].strip() or None, calls

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        deltas: list[dict] = []
        while True:
            marker = self.END if self.inside else self.START
            index = self.buffer.find(marker)
            if index < 0:
                if not self.inside:
                    keep = _partial_prefix_len(self.buffer, self.START)
                    self._content(self.buffer[: len(self.buffer) - keep], deltas)
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                return deltas
            head, self.buffer = self.buffer[:index], self.buffer[index + len(marker) :]
            if self.inside:
                self._call(head, deltas)
            else:
                self._content(head, deltas)
            self.inside = not self.inside

    def finish(self) -> list[dict]:
        deltas: list[dict] = []
        if self.inside and _call_from_json(self.buffer.strip()) is not None:
            self._call(self.buffer, deltas)  # cut off before its end tag, but complete JSON
        elif self.buffer:
            self._content((self.START if self.inside else "") + self.buffer, deltas)
        self.buffer, self.inside = "", False
        return deltas

    def _content(self, text: str, deltas: list[dict]) -> None:
        if text and not (self.num_calls and not text.strip()):  # whitespace between calls: dropped
            deltas.append({"content": text})

    def _call(self, text: str, deltas: list[dict]) -> None:
        call = _call_from_json(text.strip())
        if call is None:
            self._content(self.START + text + self.END, deltas)
            return
        self.num_calls += 1
        deltas.append({"tool_calls": [{"index": self.num_calls - 1, **call}]})


class Llama3JsonToolParser(ToolCallExtractor):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.mode: str | None = None  # "content" or "json", decided by the first visible character

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        body = text.strip()
        body = body[len(self.TAG) :].lstrip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return text, []
        calls, decoder, pos = [], json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call_from_json(json.dumps(obj))
            if call is None:
                return text, []
            calls.append(call)
            pos = len(body) - len(body[pos:].lstrip().lstrip(";").lstrip())
        self.num_calls = len(calls)
        return None, calls

    def feed(self, text: str) -> list[dict]:
        if self.mode == "content":
            return [{"content": text}] if text else []
        self.buffer += text
        visible = self.buffer.lstrip()
        if not visible or self.TAG.startswith(visible[: len(self.TAG)]) and len(visible) < len(self.TAG):
            return []  # undecided yet
        self.mode = "json" if visible.startswith(("{", self.TAG)) else "content"
        if self.mode == "content":
            text, self.buffer = self.buffer, ""
            return [{"content": text}]
        return []

    def finish(self) -> list[dict]:
        text, self.buffer = self.buffer, ""
        if not text:
            return []
        content, calls = self.extract(text)
        if not calls:
            return [{"content": content}]
        return [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
