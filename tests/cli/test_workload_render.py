"""The workload's table (``kvstrata demo`` / ``bench e2e``): a skipped tier's reason whole,
under the table; a prediction far off explained once."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from kvstrata.cli.workload import render_tiers
from kvstrata.media import Medium
from kvstrata.workload import TierReport, Workload, WorkloadReport
from kvstrata.workload.runner import NO_POOL

H, D, R = Medium.HOST, Medium.DISK, Medium.REMOTE
REASON = ("pool did not start: mooncake_master exited with 127: mooncake_master: error while loading shared "
          "libraries: libibverbs.so.1: cannot open shared object file: No such file or directory; install: "
          "apt-get install -y libibverbs1 libnuma1")


def served(tier: Medium, alone_s: float, predicted_s: float, loads: int = 10, block_bytes: int = 524_288) -> TierReport:
    return TierReport(tier, turns=loads, hit_tokens=2560, prompt_tokens=5000, restored_bytes=loads * block_bytes,
                      restore_s=alone_s * 1.5, restore_alone_s=alone_s, predicted_restore_s=predicted_s, loads=loads,
                      load_sizes=((block_bytes, 1),) * loads)


def rendered(report: WorkloadReport, width: int = 100) -> str:
    out = io.StringIO()
    render_tiers(Console(file=out, width=width, color_system=None), report, "title")
    return out.getvalue()


def flat(text: str) -> str:
    return " ".join(text.split())


def test_a_skipped_tiers_reason_is_printed_whole_under_the_table():
    report = WorkloadReport(Path("/m"), Workload(), {H: served(H, 0.004, 0.0041), R: TierReport(R, skipped=REASON)})
    text = rendered(report, width=120)  # the width the issue was seen at
    table, _, below = text.partition("└")
    assert "skipped" in table and "(see below)" in table and "libibverbs" not in table
    assert f"remote skipped: {REASON}" in flat(below)
    assert "…" not in text


def test_a_skipped_reason_naming_an_extra_keeps_its_brackets():
    report = WorkloadReport(Path("/m"), Workload(), {H: served(H, 0.004, 0.0041), R: TierReport(R, skipped=NO_POOL)})
    assert "pip install 'kvstrata[remote]'" in flat(rendered(report, width=120))


def test_a_prediction_far_off_is_explained_once_and_a_close_one_not():
    close = WorkloadReport(Path("/m"), Workload(), {H: served(H, 0.004, 0.0045), D: served(D, 0.007, 0.0062)})
    assert "error (alone):" not in rendered(close)
    off = WorkloadReport(Path("/m"), Workload(), {H: served(H, 0.004, 0.0092), D: served(D, 0.0071, 0.0023)},
                         load_average=4.8, cpus=2)
    text = flat(rendered(off, width=120))
    assert text.count("error (alone):") == 1
    assert "host, disk off by more than 50%" in text
    assert "Each load here moved 0.52 MB (1.0 blocks): at that size fixed per-call costs" in text
    assert "load average 4.8 on 2 CPUs" in text
    idle = WorkloadReport(Path("/m"), Workload(), off.tiers, load_average=0.2, cpus=2)
    assert "load average" not in rendered(idle)
