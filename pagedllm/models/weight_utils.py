"""Checkpoint-name -> parameter mapping and the generic ``load_weights`` (nano-vllm style).

A model declares ``packed_modules_mapping`` (our fused module -> the checkpoint modules it
packs, in order); each parameter's ``weight_loader`` knows its own slice and shard. A model whose
checkpoints name tensors differently (a ``bert.`` prefix, no ``model.`` prefix, heads it does
not use) also defines ``checkpoint_name(name) -> our name | None`` (None: not needed, skip it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from pagedllm.layers.sharding import ShardId, copy_checked

# Checkpoint entries that carry no weights we need (buffers some exporters save).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
    copy_checked(param, loaded_weight)


# A model's checkpoint_name: checkpoint name -> our parameter name, or None to skip the tensor.
NameMap = Callable[[str], str | None]


def name_maps(model: nn.Module) -> tuple[dict[str, list[str]], NameMap | None]:
    """The model's ``packed_modules_mapping`` and its ``checkpoint_name`` (None if it has none)."""
    return getattr(model, "packed_modules_mapping", {}), getattr(model, "checkpoint_name", None)


def map_checkpoint_name(
    name: str, packed_modules_mapping: dict[str, list[str]], rename: NameMap | None = None
) -> tuple[str, int | None] | None:
    """``model.layers.0.self_attn.k_proj.weight`` -> (``...qkv_proj.weight``, 1); None if ignorable.
    ``rename`` (a model's ``checkpoint_name``) runs first."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    if rename is not None:
        renamed = rename(name)
        if renamed is None:
            return None
        name = renamed
    for packed, parts in packed_modules_mapping.items():
        for shard_id, part in enumerate(parts):
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{packed}."), shard_id
    return name, None


def load_packed_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Feed checkpoint tensors to the parameters' loaders; unknown names are skipped (the loader
    reports them). Returns the parameter names whose every shard was loaded."""
    mapping, rename = name_maps(model)
    # remove_duplicate=False: a tied lm_head.weight in the checkpoint lands on the shared tensor.
    params = dict(model.named_parameters(remove_duplicate=False))
    shards_seen: dict[str, set[int | None]] = {}
    for name, tensor in weights:
        target = map_checkpoint_name(name, mapping, rename)
        if target is None or target[0] not in params:
            continue
        param_name, shard_id = target
        param = params[param_name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"cannot load checkpoint tensor {name!r}: {e}") from e
        shards_seen.setdefault(param_name, set()).add(shard_id)
    return {p for p, seen in shards_seen.items() if len(seen) == _num_shards(p, mapping)}


def _num_shards(param_name: str, mapping: dict[str, list[str]]) -> int:
    for packed, parts in mapping.items():
        if f".{packed}." in param_name:
            return len(parts)
    return 1


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The shards named by ``model.safetensors.index.json`` if present, else every ``*.safetensors``."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def iterate_safetensors(
    files: list[Path], keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``files`` (whose name ``keep`` accepts: the others are never read)."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)


def owned_by(model: nn.Module, prefixes: tuple[str, ...]) -> Callable[[str], bool] | None:
    """A checkpoint-name filter that drops the tensors of the modules under ``prefixes`` (another
    pipeline stage's, ``models/stage.py``); None when there are none."""
    if not prefixes:
        return None
    mapping, rename = name_maps(model)

    def keep(name: str) -> bool:
        target = map_checkpoint_name(name, mapping, rename)
        return target is None or not target[0].startswith(prefixes)

    return keep
