"""``kvstrata lab``'s bad input: one line naming what was wrong, before anything is built."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rates", "0"], "lab link rate must be a number of Gbit/s"),
        (["--sizes-mib", "64"], "needs two sizes at least"),
        (["--repeats", "0"], "repeats must be >= 1"),
    ],
)
def test_bad_lab_settings_are_refused_in_one_line(args, message):
    done = subprocess.run([sys.executable, "-m", "kvstrata", "lab", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], done.stderr
