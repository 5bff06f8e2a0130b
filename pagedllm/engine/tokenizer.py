"""Load a tokenizer from a local directory (never from a hub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"could not load a tokenizer from {path!r} ({exc}); pass a directory that holds "
            "tokenizer.json / tokenizer_config.json, or set tokenizer=..."
        ) from exc


def generation_eos_token_ids(model_dir: str) -> set[int]:
    """Extra end-of-sequence ids from generation_config.json (some models list several)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, list) else {int(eos)}
