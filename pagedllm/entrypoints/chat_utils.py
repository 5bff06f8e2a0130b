"""Chat rendering: the one place a conversation becomes prompt text and token ids.

``/v1/chat/completions``, ``/tokenize`` (with ``messages``) and ``LLM.chat`` all call
``render_chat`` / ``render_chat_ids``, so the ids ``/tokenize`` reports are exactly the ids a chat
request sends to the engine (same template, tools and template kwargs).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Arguments the renderer sets itself; chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tokenize",
        "chat_template",
        "add_generation_prompt",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
    }
)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file path, or an inline Jinja template (None: the tokenizer's own)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if _is_file(path):
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor an inline Jinja template")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # e.g. an inline template longer than a file name may be
        return False


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, str]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The conversation as prompt text (the template adds BOS itself where the model has one).

    ``chat_template``: the server's ``--chat-template`` or ``LLM.chat(chat_template=...)``; None
    uses the tokenizer's. ``tools``: OpenAI function specs the template may render; ``documents``:
    retrieved documents (``{"title", "text"}``) for templates that render them. Raises
    ValueError with a message that says what to change."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template; pass one (--chat-template for the "
            "server, chat_template=... for LLM.chat), or send a plain prompt instead"
        )
    kwargs = _template_kwargs(chat_template_kwargs, tools, continue_final_message)
    if documents is not None:
        kwargs["documents"] = documents
    try:
        text = tokenizer.apply_chat_template(
            list(messages),
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except Exception as exc:  # template errors (jinja raise_exception, bad kwargs) are the caller's to fix
        raise ValueError(f"messages could not be rendered with the chat template: {exc}") from exc
    return text


def render_chat_ids(
    tokenizer: Any, messages: Sequence[dict[str, Any]], *, add_special_tokens: bool = False, **render_kwargs: Any
) -> list[int]:
    """``render_chat`` tokenized. The rendered text already holds the template's special tokens, so
    nothing is added by default (``add_special_tokens=True`` adds the tokenizer's BOS on top)."""
    text = render_chat(tokenizer, messages, **render_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _template_kwargs(
    chat_template_kwargs: dict[str, Any] | None, tools: list[dict[str, Any]] | None, continue_final_message: bool
) -> dict[str, Any]:
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(kwargs.keys() & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs must not set {reserved}")
    if tools is not None:
        kwargs["tools"] = tools
    if continue_final_message:  # only when set: older transformers lack the argument
        kwargs["continue_final_message"] = True
    return kwargs
