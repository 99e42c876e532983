"""A load past its budget is given up: a disk far slower than computing costs a request about
its prefill, not what the disk takes.

A vLLM engine (CPU, tiny random-weight Llama, prefix caching off) whose kvstrata keeps blocks on
a disk tier capped at 0.2 MB/s, a cap the connector is not told of, stores six prompts, then is
asked them again. The disk was never loaded from, so each hit is granted whole (the first, alone,
in the step; those admitted beside it, off the step), with a budget of twice the prefill of its
tokens (the prefill measured by then); reading one would take seconds. A load is given up once it
has held the step, or its request, past its budget, its blocks are computed, and the failure tells the
scheduler the disk does not pay: the later prompts are computed without waiting on it. Every
completion is the one computed the first time. Once its probe falls due, the disk is probed off
the step: a worker reads one block only the disk holds, no request waits, and the read (as slow
as the cap) keeps the disk declined.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvstrata.kv.presets import load_geometry  # noqa: E402
from kvstrata.policies.payoff import BUDGET_FACTOR, PROBE_EVERY_S  # noqa: E402
from tests.integrations.test_vllm import BLOCK, MiB, run_children, spec  # noqa: E402

_rng = random.Random(23)
PROMPTS = [[_rng.randrange(10, 4000) for _ in range(n)] for n in (200, 260, 230, 290, 250, 270)]
NEW = [[_rng.randrange(10, 4000) for _ in range(n)] for n in (220, 240)]  # asked once the disk is declined
LATER = [[_rng.randrange(10, 4000) for _ in range(n)] for n in (210, 230)]  # asked once its probe is due
LAST = [[_rng.randrange(10, 4000) for _ in range(100)]]  # asked once the probe read has ended
CAP_GBPS = 0.0002  # 0.2 MB/s
HOST_BLOCKS = 8


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("budget")
    model = Path(tiny_model_dir)
    block_bytes = load_geometry(str(model), "bfloat16").bytes_per_token * BLOCK
    # a host tier of eight blocks: written back, the rest go down to the disk as the host evicts them
    s = spec(model, tmp, "slow", passes=[PROMPTS, PROMPTS, NEW, LATER, LAST], max_tokens=4,
             host_bytes=HOST_BLOCKS * block_bytes, disk_dir=str(tmp / "disk"), disk_bytes=64 * MiB,
             disk_read_gbps=CAP_GBPS, load_budget=BUDGET_FACTOR)
    read_s = block_bytes / (CAP_GBPS * 1e9)  # one block through the cap
    s["pauses"] = {"3": PROBE_EVERY_S + 0.5, "4": read_s + 1.0}
    return run_children({"slow": s}, tmp)["slow"] | {"block_bytes": block_bytes}


def test_a_load_from_a_disk_slower_than_computing_is_given_up_and_computed(run):
    first, again = run["passes"][:2]
    stats = again["stats"]
    assert first["stats"]["new_blocks"] > 0 and first["stats"]["load_requests"] == 0
    # the first hit was granted (never measured), ran past its budget, and was computed instead
    assert stats["late_loads"] >= 1 and "budget" in stats["last_failure"]
    assert stats["async_loads"] >= 1  # an unmeasured disk, requests running: off the step
    assert stats["recomputed_blocks"] >= stats["failed_blocks"] > 0
    # waiting on the disk for one prompt's hit would have taken this long; the pass took far less
    one_hit_s = min((len(p) - 1) // BLOCK for p in PROMPTS) * run["block_bytes"] / (CAP_GBPS * 1e9)
    assert one_hit_s > 1.5 and again["seconds"] < one_hit_s / 2, (again["seconds"], one_hit_s)
    assert again["tokens"] == first["tokens"]


def test_a_disk_whose_loads_are_declined_is_not_written_to_until_its_probe_is_due(run):
    """Once the disk no longer pays (its loads were given up), the new prompts' blocks the host
    evicts are dropped, not written to it (counted): they would not be loaded. The probe is not
    due for 5 s, longer than the passes take here."""
    first, again, new = run["passes"][:3]
    assert first["stats"]["unwritten_blocks"] == {}  # the disk was never declined: written back as usual
    assert first["stats"]["stored_bytes"] > 0
    unwritten = new["stats"]["unwritten_blocks"].get("disk", 0) - again["stats"]["unwritten_blocks"].get("disk", 0)
    stored = new["stats"]["new_blocks"] - again["stats"]["new_blocks"]
    assert stored > 0 and unwritten >= stored - HOST_BLOCKS  # all but what the host still holds
    assert new["cached"] == [0, 0] and new["stats"]["failed_blocks"] == again["stats"]["failed_blocks"]


def test_a_declined_disk_is_probed_off_the_step_once_its_probe_is_due(run):
    """Its probe due, the disk is read once by a worker's probe thread (a block only it holds,
    through the cap), while the requests of that pass compute: none of them waits on the disk, none
    loads from it, and the slow read keeps it declined."""
    new, later, last = run["passes"][2:]
    assert new["stats"]["probe_reads"] == {}  # not due during the first passes
    assert last["stats"]["probe_reads"] == {"disk": 1}
    read_s = run["block_bytes"] / (CAP_GBPS * 1e9)
    assert last["stats"]["probe_seconds"] >= 0.8 * read_s  # the read went through the cap
    assert later["cached"] == [0, 0] and last["cached"] == [0]
    assert last["stats"]["failed_blocks"] == new["stats"]["failed_blocks"]  # no request's load tried the disk
    assert later["tokens"] and last["tokens"]
