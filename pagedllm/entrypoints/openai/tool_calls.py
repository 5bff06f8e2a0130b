"""Tool calls in chat: the schema that forces them (tool_choice "required" or a named function),
and turning the generated text into OpenAI ``tool_calls``, whole or as streaming deltas.

Forced calls are generated as JSON that the schema guarantees: a named function's output is its
arguments object; "required" outputs ``[{"name": ..., "parameters": {...}}, ...]`` (vLLM's
format). ``tool_choice: "auto"`` lets the model write what it likes; a ``ToolParser``
(tool_parsers.py) finds the calls in the text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pagedllm.entrypoints.openai.errors import RequestParamError

_EMPTY_OBJECT = {"type": "object", "properties": {}}
# The head of one item of a "required" array, as the schema's compact JSON writes it.
_ITEM_HEAD = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str) -> dict:
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------------------------- schemas
def tool_choice_schema(tools: list[Any], choice: Any, parallel: bool) -> dict | None:
    """The JSON schema a forced tool choice puts on the output; None for "none" and "auto"."""
    if choice in ("none", "auto"):
        return None
    if choice == "required":
        return _required_schema(tools, parallel)
    tool = next(t for t in tools if t.function.name == choice.function.name)
    return tool.function.parameters or _EMPTY_OBJECT


def _required_schema(tools: list[Any], parallel: bool) -> dict:
    """An array of {"name", "parameters"} items, each matching one tool; the tools' ``$defs``
    move to the top so their ``#/$defs/...`` references still resolve."""
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        parameters = dict(tool.function.parameters or _EMPTY_OBJECT)
        for key, value in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise RequestParamError(f"tools define different schemas under $defs/{key}; rename one", "tools")
        items.append(
            {
                "type": "object",
                "required": ["name", "parameters"],
                "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# ---------------------------------------------------------------------------------- extraction
class ToolCallExtractor:
    """One choice's tool calls: ``extract`` for a whole text; ``feed`` + ``finish`` while streaming
    (each returns OpenAI delta dicts: ``{"content": ...}`` or ``{"tool_calls": [...]}``)."""

    def __init__(self) -> None:
        self.num_calls = 0

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        raise NotImplementedError

    def feed(self, text: str) -> list[dict]:
        raise NotImplementedError

    def finish(self) -> list[dict]:
        return []

    def _new_call(self, name: str, arguments: str = "") -> dict:
        self.num_calls += 1
        call = tool_call(name, arguments)
        return {"tool_calls": [{"index": self.num_calls - 1, **call}]}

    def _arguments(self, text: str) -> dict:
        return {"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": text}}]}


class NamedToolCall(ToolCallExtractor):
    """The whole output is the named function's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        self.num_calls = 1
        return None, [tool_call(self.name, text)]

    def feed(self, text: str) -> list[dict]:
        deltas = [] if self.num_calls else [self._new_call(self.name)]
        if text:
            deltas.append(self._arguments(text))
        return deltas


class RequiredToolCalls(ToolCallExtractor):
    """The output is ``[{"name": ..., "parameters": {...}}, ...]``; streamed, each item's
    parameters go out as argument deltas while they are generated."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.pos = 0  # buffer[:pos] is handled
        self.in_arguments = False
        self.args_started = False
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        try:
            items = json.loads(text)
        except ValueError:
            return text, []  # cut off by max_tokens
        calls = [tool_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
        self.num_calls = len(calls)
        return None, calls

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        deltas: list[dict] = []
        while self.pos < len(self.buffer):
            if self.in_arguments:
                chunk = self._scan_arguments()
                if not self.args_started:
                    chunk = chunk.lstrip()
                    self.args_started = bool(chunk)
                if chunk:
                    deltas.append(self._arguments(chunk))
                if self.in_arguments:
                    break
            else:
                match = _ITEM_HEAD.match(self.buffer, self.pos)
                if match is None:
                    break  # the next item's head is not complete yet (or the array ended)
                deltas.append(self._new_call(json.loads(f'"{match.group(1)}"')))
                self.pos, self.in_arguments, self.depth = match.end(), True, 0
                self.args_started = False
        return deltas

    def _scan_arguments(self) -> str:
        """Consume the parameters value up to its end (a ',' or '}' at depth 0 outside strings)."""
        start = self.pos
        for i in range(self.pos, len(self.buffer)):
            ch = self.buffer[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]" and self.depth > 0:
                self.depth -= 1
            elif ch in ",}" and self.depth == 0:
                self.in_arguments = False
                self.pos = i + 1 if ch == "}" else i  # '}' closes the item; ',' belongs to the next
                return self.buffer[start:i]
        self.pos = len(self.buffer)
        return self.buffer[start:]
