"""Load a tokenizer from a local directory (never from a hub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedllm.gguf_config import is_gguf_file


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a model directory, or the one a .gguf file's metadata describes
    (vocabulary, merges, special tokens and chat template; transformers converts it)."""
    from transformers import AutoTokenizer

    where, kwargs = _tokenizer_source(path)
    try:
        return AutoTokenizer.from_pretrained(
            where, trust_remote_code=trust_remote_code, local_files_only=True, **kwargs
        )
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"could not load a tokenizer from {path!r} ({exc}); pass a directory that holds "
            "tokenizer.json / tokenizer_config.json, a .gguf file, or set tokenizer=..."
        ) from exc


def _tokenizer_source(path: str) -> tuple[str, dict[str, str]]:
    if is_gguf_file(path):
        return str(Path(path).parent), {"gguf_file": Path(path).name}
    return path, {}


def generation_eos_token_ids(model_dir: str) -> set[int]:
    """Extra end-of-sequence ids from generation_config.json (some models list several)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, list) else {int(eos)}
