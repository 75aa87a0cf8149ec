"""Fixtures for the engine tests (helpers live in engine_helpers.py)."""

from __future__ import annotations

import pytest

from rose.engine.presets import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()
