"""The demo/test tokenizer: a deterministic byte-level BPE trained on ``corpus.corpus()``, with
Llama-style BOS, ChatML-style turn markers and a chat template. ``tokenizers``/``transformers``
are imported lazily."""

from __future__ import annotations

import functools
import os
from collections import Counter
from typing import TYPE_CHECKING, Any

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


# Encoder special tokens, ids 0.. in this order: BERT's [PAD] is 0; RoBERTa's <pad> is 1, which
# sets its position offset (pad_token_id + 1), as in the real checkpoints.
ENCODER_SPECIAL_TOKENS = {
    "bert": {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"},
    "roberta": {"cls": "<s>", "pad": "<pad>", "sep": "</s>", "unk": "<unk>", "mask": "<mask>"},
}


@functools.lru_cache(maxsize=8)
def _wordpiece_json(style: str, vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    specials = ENCODER_SPECIAL_TOKENS[style]
    normalizer, pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    vocab = _wordpiece_vocab(list(specials.values()), vocab_size, normalizer, pre_tokenizer)
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token=specials["unk"]))
    tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, pre_tokenizer, decoders.WordPiece()
    tok.add_special_tokens(list(specials.values()))
    cls, sep = specials["cls"], specials["sep"]
    # [CLS] text [SEP] (RoBERTa: <s> text </s>), what sentence embedders are trained on.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    return tok.to_str()


def _wordpiece_vocab(specials: list[str], vocab_size: int, normalizer: Any, pre_tokenizer: Any) -> dict[str, int]:
    """specials, every corpus character alone and as ``##c``, then the most frequent words.

    Built by hand rather than with ``WordPieceTrainer``, whose vocabulary changes from run to run
    (hash-ordered ties); this one is the same every time, ids included."""
    counts = Counter(
        word for text in corpus() for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))
    )
    chars = sorted({c for word in counts for c in word})
    pieces = [*specials, *chars, *(f"##{c}" for c in chars)]
    words = sorted((w for w in counts if len(w) > 1), key=lambda w: (-counts[w], w))
    pieces += words[: max(0, vocab_size - len(pieces))]
    return {piece: i for i, piece in enumerate(pieces)}


def build_encoder_tokenizer(
    path: str | os.PathLike | None = None, *, style: str = "bert", vocab_size: int = 512
) -> PreTrainedTokenizerFast:
    """A deterministic WordPiece tokenizer for the tiny encoders (``vocab_size`` pieces, more if the
    corpus has more characters than fit) that wraps each text in
    [CLS] ... [SEP] (``style="roberta"``: <s> ... </s>, <pad> = 1). Saved to ``path`` if given."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if style not in ENCODER_SPECIAL_TOKENS:
        raise ValueError(f"unknown tokenizer style {style!r}; choose one of {sorted(ENCODER_SPECIAL_TOKENS)}")
    specials = ENCODER_SPECIAL_TOKENS[style]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_wordpiece_json(style, vocab_size)),
        **{f"{role}_token": token for role, token in specials.items()},
        model_max_length=1 << 20,
    )
    if path is not None:
        tok.save_pretrained(str(path))
    return tok
