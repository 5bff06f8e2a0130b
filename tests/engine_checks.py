"""Checks that tests of the offline engine end with: nothing left running, the block pool whole."""

from __future__ import annotations

from typing import Any


def assert_idle_and_intact(llm: Any) -> None:
    """No request left in the front end or the engine core, and the block pool's integrity check
    passes (every block free, cached or used by a live request)."""
    assert not llm.llm_engine.has_unfinished_requests()
    assert not llm.llm_engine.engine_core.has_unfinished_requests()
    llm.llm_engine.check_integrity()
