"""Choosing the distributed backend: checked before anything starts, with errors that say what to do."""

from __future__ import annotations

import sys

import pytest

from pagedllm import LLM
from pagedllm.config.parallel import ParallelArgs


def test_ray_backend_without_ray_names_the_extra(llama_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: importing it fails
    with pytest.raises(ValueError, match=r"pip install 'pagedllm\[ray\]'"):
        LLM(str(llama_model_dir), tensor_parallel_size=2, distributed_executor_backend="ray")


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of mp, ray"):
        ParallelArgs(distributed_executor_backend="mpi").create_parallel_config()


def test_default_backend_is_mp():
    assert ParallelArgs(tensor_parallel_size=2).create_parallel_config().distributed_executor_backend == "mp"
