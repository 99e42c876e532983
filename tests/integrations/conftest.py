"""A tiny random-weight Llama model, built offline once per session (a few seconds)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from kvstrata.integrations.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-model"))
