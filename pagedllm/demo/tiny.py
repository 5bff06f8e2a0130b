"""Tiny random-weight Hugging Face models: the tests' oracle fixtures and the built-in demo model.

Everything is built locally (no hub): a byte-level BPE tokenizer trained on a built-in corpus,
and a config + random weights saved in the standard HF layout (config.json, safetensors,
tokenizer.json, generation_config.json). torch/transformers are imported lazily because the
CLI imports this module.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm import envs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD, IM_START, IM_END, ENDOFTEXT = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
)
# ids 0..5 in this order. <|endoftext|> is unused by us, but transformers' Qwen2Tokenizer (which
# AutoTokenizer forces for model_type "qwen2") adds it as unk_token unless it is already there.
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END, ENDOFTEXT]
# Qwen2's pre-tokenizer split (GPT-4-like, single digits) and NFC normaliser. AutoTokenizer
# rebuilds a qwen2 checkpoint's tokenizer with exactly these, so every arch uses them to stay
# identical (copied from transformers/models/qwen2/tokenization_qwen2.py).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The rendered prompt starts with BOS, so tokenize it with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

DEMO_MODEL_NAME = "pagedllm-demo"
_ARCHES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
_DTYPES = ("float32", "float16", "bfloat16")

# ---------------------------------------------------------------------------------------------
# Corpus: hand-written lines + deterministic template sentences + code/JSON/digits/non-ASCII.
# ---------------------------------------------------------------------------------------------
_WORDS = """
the a an this that these every some many few no one two three four five ten hundred thousand
time year people way day man woman child world life hand part place case week company system
program question work government number night point home water room mother area money story
fact month lot right study book eye job word business issue side kind head house service friend
father power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war history
party result change morning reason research girl guy moment air teacher force education model
engine memory cache block token request server client batch queue kernel tensor layer weight
river mountain forest garden ocean island village market bridge castle library museum station
be have do say go get make know think take see come want look use find give tell work call try
ask need feel become leave put mean keep let begin seem help talk turn start show hear play run
move like live believe hold bring happen write provide sit stand lose pay meet include continue
set learn lead understand watch follow stop create speak read allow add spend grow open walk win
offer remember love consider appear buy wait serve die send expect build stay fall cut reach
good new first last long great little own other old big high different small large next early
young important public bad same able quick brown lazy bright dark quiet loud warm cold gentle
and or but if because while when where after before since until although though so than
in on at by for with about against between into through during without under over above
quickly slowly carefully often never always sometimes usually really very quite almost
""".split()
_NAMES = "Alice Bob Carol Dave Eve Mallory Paris London Tokyo Berlin Monday Friday Python Linux".split()
_LINES = """The quick brown fox jumps over the lazy dog.
Once upon a time, in a village by the river, there lived an old clockmaker.
Paged attention stores the key-value cache in fixed-size blocks of sixteen tokens.
Continuous batching lets a finished request free its memory in the very next step.
What is the capital of France? The capital of France is Paris.
Please summarize the following article in three sentences.
I can't believe it's already Friday; the week went by so fast!
"Hello," she said. "How are you doing today?" He smiled and said nothing.
Water boils at 100 degrees Celsius (212 degrees Fahrenheit) at sea level.
The meeting is scheduled for 2024-03-15 at 09:30 UTC, in room B-204.
Call +1 (555) 867-5309 or email support@example.com for help.
Prices rose 3.5% in Q2, from $1,299.99 to $1,345.50 per unit.
def fibonacci(n: int) -> int:
    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
import torch; x = torch.zeros((4, 16), dtype=torch.float32)
{"model": "pagedllm-demo", "messages": [{"role": "user", "content": "Hi!"}], "stream": true}
{"id": 42, "tags": ["a", "b"], "ok": false, "score": null, "ratio": 0.75}
SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY 2 DESC;
<html><body><p class="note">Hello &amp; welcome</p></body></html>
Café, naïve, façade, résumé, jalapeño, Zürich, Ångström, smørrebrød.
Größe, Straße, Übung, Äpfel, Öl; ¿Dónde está la biblioteca? ¡Olé!
Ελληνικά: γειά σου κόσμε. Русский: привет, мир. Українська: дякую.
中文：你好，世界。日本語：こんにちは世界。한국어: 안녕하세요 세계.
עברית: שלום עולם. العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया.
Emoji: 😀 🚀 🎉 👍🏽 ❤️ 🇫🇷 — and symbols: © ® ™ € £ ¥ ° ± × ÷ ∑ √ ∞ ≤ ≥ →.
Tabs\tand  double  spaces, trailing spaces   , and a line with only digits: 0123456789.
""".replace("\\t", "\t").splitlines()


def _generated_lines(n: int, seed: int = 1234) -> list[str]:
    """Deterministic pseudo-English sentences, numbers and key/value snippets."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(_NAMES))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice(".!?,;:"))
        if i % 7 == 0:
            out.append(f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)} = {rng.randint(0, 10**rng.randint(1, 9))}")
        if i % 11 == 0:
            out.append(json.dumps({rng.choice(_WORDS): rng.random(), "n": rng.randint(-999, 999)}))
    return out


def corpus() -> list[str]:
    """The tokenizer training corpus (deterministic)."""
    return _LINES * 4 + _generated_lines(1500)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _train_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)],
    )
    return tok.to_str()


def build_tokenizer(
    path: str | os.PathLike | None = None, *, vocab_size: int = 512
) -> PreTrainedTokenizerFast:
    """Train (cached per process) a deterministic byte-level BPE and wrap it for transformers.

    Encoding adds BOS by default (like Llama); the chat template also starts with BOS.
    Saved with save_pretrained(path) when path is given.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tokenizer_json(vocab_size)),
        bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        add_bos_token=True, add_eos_token=False, chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20, clean_up_tokenization_spaces=False,
    )
    if path is not None:
        tok.save_pretrained(str(path))
    return tok


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def _rope_parameters(rope_scaling: dict | None, rope_theta: float) -> dict:
    """Classic `rope_scaling` dict -> transformers>=5 `rope_parameters` (theta folded in)."""
    params = dict(rope_scaling or {})
    if "type" in params:  # pre-4.45 spelling
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    params["rope_theta"] = float(params.get("rope_theta", rope_theta))
    return params


def _sliding_kwargs(arch: str, sliding_window: int | None) -> dict[str, Any]:
    if sliding_window is None:
        return {"sliding_window": None} if arch == "mistral" else {}
    if arch == "llama":
        raise ValueError("llama has no sliding window; use arch='mistral', 'qwen2' or 'qwen3'")
    if arch == "mistral":
        return {"sliding_window": sliding_window}
    # Qwen: layers with index >= max_window_layers slide; 0 means every layer slides.
    return {"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": 0}


def _validate_args(arch: str, dtype: str, head_dim: int | None, derived_head_dim: int) -> None:
    if arch not in _ARCHES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(_ARCHES)}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {_DTYPES}")
    if arch == "qwen2" and head_dim not in (None, derived_head_dim):
        raise ValueError("qwen2 derives head_dim = hidden_size // num_heads; change those instead")


def _make_config(arch: str, tok: Any, vocab_size: int | None, kw: dict[str, Any]) -> Any:
    import transformers

    if vocab_size is not None and vocab_size < len(tok):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tok)} tokens)")
    config_cls = getattr(transformers, _ARCHES[arch][0])
    return config_cls(
        vocab_size=vocab_size or len(tok), bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw,
    )


def _std_for(name: str, shape: tuple[int, ...]) -> float:
    if "norm" in name:
        return 0.1  # added to 1.0
    if name.endswith("bias"):
        return 0.1
    if "embed_tokens" in name:
        return 0.1  # small, so attention (not the current token) dominates the residual stream
    return (2.0 if "lm_head" in name else 1.0) / shape[-1] ** 0.5


def _reinit_weights(model: Any, seed: int) -> None:
    """HF's std=0.02 init gives flat logits on tiny models (greedy ties); use fan-in scaling."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            noise *= _std_for(name, tuple(p.shape))
            p.copy_(noise + 1.0 if "norm" in name else noise)


def _is_complete(path: Path) -> bool:
    has_weights = (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()
    return (path / "config.json").exists() and has_weights


def _publish(tmp: Path, path: Path) -> None:
    """Move a finished build into place; a concurrent builder that got there first wins."""
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()
    try:
        os.rename(tmp, path)
    except OSError:
        if not _is_complete(path):
            if not path.exists():
                raise
            for f in tmp.iterdir():  # pre-existing non-empty dir: fill it in
                os.replace(f, path / f.name)
        shutil.rmtree(tmp, ignore_errors=True)


def build_tiny_model(
    path: str | os.PathLike,
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    tokenizer_vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    sliding_window: int | None = None,
    dtype: str = "float32",
    shard_size: str | int | None = None,
    **config_overrides: Any,
) -> Path:
    """Build (or reuse, if `path` already holds config.json + weights) a tiny random HF model.

    `rope_scaling` takes the classic dict and lands in config.json as `rope_parameters`
    (with `rope_theta`; pass `rope_theta=` to change it). Returns `path`.
    """
    path = Path(path)
    if _is_complete(path):
        return path
    _validate_args(arch, dtype, head_dim, hidden_size // num_heads)
    kw = dict(
        hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim or hidden_size // num_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, dtype=dtype,
        rope_parameters=_rope_parameters(rope_scaling, config_overrides.pop("rope_theta", 10000.0)),
        **_sliding_kwargs(arch, sliding_window),
    )
    if arch == "qwen2":
        kw.pop("head_dim")  # Qwen2Config has no head_dim field: always hidden_size // num_heads
    tok = build_tokenizer(vocab_size=tokenizer_vocab_size)
    model = _make_model(arch, tok, vocab_size, {**kw, **config_overrides}, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the published dir should be readable like any other
    try:
        with _quiet_progress():
            model.save_pretrained(str(tmp), **({} if shard_size is None else {"max_shard_size": shard_size}))
        tok.save_pretrained(str(tmp))
        _publish(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _make_model(arch: str, tok: Any, vocab_size: int | None, config_kw: dict[str, Any], seed: int) -> Any:
    import torch
    import transformers

    config = _make_config(arch, tok, vocab_size, config_kw)
    torch.manual_seed(seed)
    model = getattr(transformers, _ARCHES[arch][1])(config)
    _reinit_weights(model, seed)
    model = model.to(getattr(torch, config_kw["dtype"])).eval()
    # Like Qwen/Llama-3 chat models: generation also stops at the chat turn terminator.
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)]
    return model


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------------------------------------
# Demo model
# ---------------------------------------------------------------------------------------------
_DEMO_README = f"""# {DEMO_MODEL_NAME}: RANDOM WEIGHTS, GIBBERISH OUTPUT

**WARNING: this model's weights are RANDOM. It has never been trained. Everything it
generates is GIBBERISH.** It exists only so that `pagedllm serve` has a real
Llama-architecture model to run with no downloads (its tokenizer is a byte-level BPE trained
on a small built-in corpus). Built by `pagedllm.demo.tiny.ensure_demo_model()`; delete this
directory to rebuild it.
"""


def default_cache_dir() -> Path:
    """`$PAGEDLLM_CACHE`, else `~/.cache/pagedllm`."""
    return envs.cache_dir()


def ensure_demo_model() -> Path:
    """Build the demo model once into `<cache>/demo-llama` (atomically) and return its path."""
    path = default_cache_dir() / "demo-llama"
    if _is_complete(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-llama.build-", dir=path.parent))
    try:
        build_tiny_model(
            staging / "model", "llama", seed=0, tokenizer_vocab_size=2048, hidden_size=256,
            num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=688,
            max_position_embeddings=2048,
        )
        (staging / "model" / "README.md").write_text(_DEMO_README)
        _publish(staging / "model", path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
