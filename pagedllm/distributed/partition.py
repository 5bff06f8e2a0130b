"""How a pipeline's stages split the decoder layers (torch-free: the config checks it at start-up)."""

from __future__ import annotations

from pagedllm import envs


def parse_partition(value: str, num_layers: int, pp: int) -> list[int]:
    """``"a,b,..."`` -> layers per stage; ValueError saying what to change when it does not fit."""
    where = f"PAGEDLLM_PP_LAYER_PARTITION={value!r}"
    try:
        sizes = [int(part) for part in value.split(",")]
    except ValueError:
        raise ValueError(f"{where} must be comma-separated layer counts, one per stage, e.g. '2,1'") from None
    if len(sizes) != pp:
        raise ValueError(f"{where} has {len(sizes)} entries; pipeline_parallel_size={pp} needs {pp}")
    if any(n < 1 for n in sizes):
        raise ValueError(f"{where}: every stage needs at least one layer")
    if sum(sizes) != num_layers:
        raise ValueError(f"{where} sums to {sum(sizes)}; the model has {num_layers} layers")
    return sizes


def layer_partition(num_layers: int, pp: int) -> list[int]:
    """Layers per stage: ``PAGEDLLM_PP_LAYER_PARTITION`` if set, else as even as possible."""
    if pp > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers; use at most {num_layers} stages"
        )
    value = envs.get("PAGEDLLM_PP_LAYER_PARTITION")
    if value:
        return parse_partition(value, num_layers, pp)
    base, extra = divmod(num_layers, pp)
    sizes = [base] * pp
    for stage in range(pp - 1 - extra, pp - 1):  # the leftovers: the stages just before the last
        sizes[stage] += 1
    return sizes
