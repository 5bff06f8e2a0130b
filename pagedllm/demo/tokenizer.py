"""The demo/test tokenizer: a deterministic byte-level BPE trained on ``corpus.corpus()``, with
Llama-style BOS, ChatML-style turn markers and a chat template. ``tokenizers``/``transformers``
are imported lazily."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from pagedllm.demo.corpus import corpus

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD, IM_START, IM_END, ENDOFTEXT = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
)
# ids 0..5 in this order. <|endoftext|> is unused by us, but transformers' Qwen2Tokenizer (which
# AutoTokenizer forces for model_type "qwen2") adds it as unk_token unless it is already there.
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END, ENDOFTEXT]
# Qwen2's pre-tokenizer split (GPT-4-like, single digits) and NFC normaliser. AutoTokenizer
# rebuilds a qwen2 checkpoint's tokenizer with exactly these, so every arch uses them to stay
# identical (copied from transformers/models/qwen2/tokenization_qwen2.py).
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# The rendered prompt starts with BOS, so tokenize it with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@functools.lru_cache(maxsize=8)
def _train_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tok.to_str()


def build_tokenizer(path: str | os.PathLike | None = None, *, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train (cached per process) a deterministic byte-level BPE and wrap it for transformers.

    Encoding adds BOS by default (like Llama); the chat template also starts with BOS.
    Saved with save_pretrained(path) when path is given.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tokenizer_json(vocab_size)),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        add_bos_token=True,
        add_eos_token=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    if path is not None:
        tok.save_pretrained(str(path))
    return tok
