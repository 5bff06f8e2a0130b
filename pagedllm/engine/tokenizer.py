"""Load a tokenizer from a local directory (never from a hub)."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pagedllm import envs
from pagedllm.gguf_config import is_gguf_file


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a model directory, or the one a .gguf file's metadata describes
    (vocabulary, merges, special tokens and chat template; transformers converts it once, and
    the result is cached under ``$PAGEDLLM_CACHE/gguf-tokenizers``)."""
    try:
        if is_gguf_file(path):
            return _gguf_tokenizer(Path(path))
        return _from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"could not load a tokenizer from {path!r} ({exc}); pass a directory that holds "
            "tokenizer.json / tokenizer_config.json, a .gguf file, or set tokenizer=..."
        ) from exc


def _from_pretrained(where: str | Path, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(where), local_files_only=True, **kwargs)


def _gguf_tokenizer(path: Path) -> Any:
    """Converting a GGUF vocabulary takes transformers seconds (5-17 s for SmolLM2's 49k tokens on
    2 busy cores); the saved conversion loads in about one."""
    cached = gguf_tokenizer_cache(path)
    if (cached / "tokenizer_config.json").is_file():
        return _from_pretrained(cached)
    tokenizer = _from_pretrained(path.parent, gguf_file=path.name)
    with contextlib.suppress(OSError):  # a read-only cache only costs the next start its conversion
        _save_atomically(tokenizer, cached)
    return tokenizer


def gguf_tokenizer_cache(path: Path) -> Path:
    """Where the converted tokenizer of the GGUF file ``path`` is kept: keyed by its name, size
    and modification time, so a replaced file is converted again."""
    stat = path.stat()
    return envs.cache_dir() / "gguf-tokenizers" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def _save_atomically(tokenizer: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        tokenizer.save_pretrained(str(staging))
        staging.rename(path)  # fails if another process published it first: theirs is as good
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def generation_eos_token_ids(model_dir: str) -> set[int]:
    """Extra end-of-sequence ids from generation_config.json (some models list several)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, list) else {int(eos)}
