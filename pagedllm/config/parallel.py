"""Parallelism: ``ParallelArgs`` -> frozen ``ParallelConfig`` (only 1 x 1 runs today)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config.options import check_positive, option


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass
class ParallelArgs:
    """How many ranks share the model."""

    tensor_parallel_size: int = option(
        1, "tensor-parallel ranks; accepted and validated, only 1 is supported for now", aliases=("-tp",)
    )
    pipeline_parallel_size: int = option(
        1, "pipeline-parallel stages; accepted and validated, only 1 is supported for now", aliases=("-pp",)
    )

    def create_parallel_config(self) -> ParallelConfig:
        check_positive("tensor_parallel_size", self.tensor_parallel_size)
        check_positive("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.tensor_parallel_size != 1 or self.pipeline_parallel_size != 1:
            raise ValueError(
                "tensor/pipeline parallelism is not available yet: use tensor_parallel_size=1 "
                "and pipeline_parallel_size=1"
            )
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size)
