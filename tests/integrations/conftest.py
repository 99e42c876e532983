"""Tiny random-weight hybrid and MLA models, built offline once per session (the Llama is
``tiny_model_dir`` in tests/conftest.py, which tests/bench uses too)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_hybrid_dirs(tmp_path_factory):
    """Tiny hybrids by kind: Gemma 2 (sliding + full attention), Qwen3-Next (linear + full)."""
    pytest.importorskip("transformers")
    from kvstrata.integrations.tiny import HybridKind, TinyHybridSpec, make_tiny_hybrid

    return {kind: make_tiny_hybrid(tmp_path_factory.mktemp(f"tiny-{kind.value}"), TinyHybridSpec(kind=kind))
            for kind in HybridKind}


@pytest.fixture(scope="session")
def tiny_mla_dir(tmp_path_factory):
    """A tiny DeepSeek-V2-Lite-shaped MLA model (random weights, built offline)."""
    pytest.importorskip("transformers")
    from kvstrata.integrations.tiny import make_tiny_mla

    return make_tiny_mla(tmp_path_factory.mktemp("tiny-mla"))
