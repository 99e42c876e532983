"""Fixtures of SGLang's HiCache storage tests: SGLang's real classes (host pools on a CPU, the
storage factory, the controller's own backup and prefetch) against kvstrata's backend.

Where SGLang is not installed (the main venv, which has vLLM's CPU build) every test module
here skips as it imports ``sglang_support``; they run in ``.venv-sglang`` (``bash
.ci/sglang-venv``). So this file imports SGLang's side only inside its fixtures: a skip raised
while pytest loads a conftest it was pointed at directly is an error, not a skip.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pytest


@pytest.fixture(scope="session")
def pool_file(request, tmp_path_factory) -> str:
    """The session pool (tests/conftest.py) as a TOML file, the way an SGLang user names it."""
    pool = request.getfixturevalue("pool")
    lines = [f"{k} = {json.dumps(v)}" for k, v in pool.to_json().items() if v is not None]
    path = tmp_path_factory.mktemp("sglang-pool") / "pool.toml"
    path.write_text("[pool]\n" + "\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def model() -> str:
    """A model name of this test's own: the session pool keeps objects of earlier tests and runs."""
    return f"sglang-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["disk", "pool"])
def tier(request, tmp_path) -> dict:
    """kvstrata options of one tier: a disk directory, or the pool."""
    from sglang_support import DISK_BYTES, REMOTE_BYTES

    if request.param == "disk":
        return {"disk_dir": str(tmp_path / "disk"), "disk_bytes": DISK_BYTES}
    return {"pool": request.getfixturevalue("pool_file"), "remote_bytes": REMOTE_BYTES}


@pytest.fixture
def backends(model) -> Callable:
    """``make(host, *, v1=True, tp_rank=0, tp_size=1, metrics=False, fields={}, **kvstrata options)``:
    a backend built by SGLang's dynamic factory for ``host``, in this test's model; closed after."""
    from kvstrata.integrations.sglang import harness

    made = []

    def make(host, *, v1: bool = True, tp_rank: int = 0, tp_size: int = 1, metrics: bool = False,
             fields: dict | None = None, model_name: str | None = model, **options):
        config = harness.storage_config(host, harness.backend_extra(v1, **options), tp_rank=tp_rank,
                                        tp_size=tp_size, model_name=model_name, metrics=metrics, **(fields or {}))
        backend = harness.create_backend(config, host)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()
