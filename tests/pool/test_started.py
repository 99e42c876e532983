"""A process stamp tells the process it was taken of from any later holder of its pid, and from
a process that has exited."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvstrata.pool.started import ProcessStamp


def test_a_stamp_names_the_processs_executable_and_holds_for_it_only():
    own = ProcessStamp.of(os.getpid())
    assert own.exe == os.path.realpath(sys.executable)
    assert own.holds(os.getpid()) and own == ProcessStamp.of(os.getpid())
    with subprocess.Popen(["sleep", "60"]) as other:
        try:
            theirs = ProcessStamp.of(other.pid)
            assert theirs.exe.endswith("/sleep") and theirs.start_ticks >= own.start_ticks
            assert not own.holds(other.pid) and theirs.holds(other.pid)
        finally:
            other.kill()


def test_a_process_whose_name_holds_spaces_and_parentheses_is_read_right(tmp_path):
    odd = tmp_path / "a) 1 2 (b"  # its name in /proc/<pid>/stat: "(a) 1 2 (b)", fields shifted if split at ")"
    odd.symlink_to("/bin/sleep")
    with subprocess.Popen([str(odd), "60"]) as named, subprocess.Popen(["sleep", "60"]) as plain:
        try:
            ticks = ProcessStamp.of(named.pid).start_ticks, ProcessStamp.of(plain.pid).start_ticks
            assert 0 <= ticks[1] - ticks[0] < 100  # started within a second of each other, in that order
        finally:
            named.kill()
            plain.kill()


def test_an_exited_process_holds_no_stamp_even_before_it_is_reaped():
    proc = subprocess.Popen(["true"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # a zombie now: exited, not reaped
    with pytest.raises(ProcessLookupError):
        ProcessStamp.of(proc.pid)
    proc.wait()


def test_a_stamp_round_trips_through_json_and_refuses_what_is_not_one():
    stamp = ProcessStamp(12345, "/usr/bin/mooncake_master")
    assert ProcessStamp.from_json(stamp.to_json()) == stamp
    for doc in ({"start_ticks": "1", "exe": "/x"}, {"exe": "/x"}, [1, "/x"], None):
        with pytest.raises(TypeError):
            ProcessStamp.from_json(doc)
