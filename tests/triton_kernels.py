"""Import a Triton kernel module for a test: compiled on CUDA, else decorated for Triton's CPU
interpreter (TRITON_INTERPRET=1 set for the import, the environment left as it was)."""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import pytest


def import_kernels(module: str, cuda: bool) -> ModuleType:
    """``module`` imported; the test (or the importing test module) is skipped without triton."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is not installed", allow_module_level=True)
    old = os.environ.get("TRITON_INTERPRET")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module(module)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
