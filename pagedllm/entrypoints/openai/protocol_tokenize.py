"""Request models of the tokenizer routes (``/tokenize``, ``/detokenize``)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.errors import RequestParamError
from pagedllm.entrypoints.openai.protocol import ChatMessage, ChatTemplateRequest
from pagedllm.entrypoints.openai.protocol_base import LaxBool, OpenAIBaseModel


class TokenizeRequest(ChatTemplateRequest):
    """POST /tokenize: a ``prompt``, or chat ``messages`` (with the chat fields: tools,
    chat_template_kwargs, ...) rendered exactly as a chat completion renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None  # type: ignore[assignment]  # optional here
    add_special_tokens: LaxBool | None = None  # type: ignore[assignment]  # default: True for a prompt, False for messages
    return_token_strs: LaxBool | None = False  # also the tokens as the tokenizer's strings

    def check_input(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestParamError("pass exactly one of 'prompt' (a string) or 'messages' (a chat)", "prompt")


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]
