"""A process stamp tells the process it was taken of from any later holder of its pid, and from
a process that has exited."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvstrata.pool.started import TOKEN_ENV, ProcessStamp, carries, carrying, new_token


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


def test_a_process_carries_its_token_across_an_exec():
    # The pool's programs are wrappers that exec the engine's binaries; read mid-exec, a process's
    # environment is empty for about a millisecond, and a scan then missed the daemon a killed
    # start had left running. Read in a tight loop across the exec, it carries the token throughout.
    token = new_token()
    # Wrappers exec'ing each other five times, then sleep: six execs, each read across.
    wrapper = ("import os, sys, time; n = int(sys.argv[1]); time.sleep(0.02); "
               "os.execv(sys.executable, [sys.executable, '-c', sys.argv[2], str(n - 1), sys.argv[2]]) if n "
               "else os.execv('/bin/sleep', ['sleep', '60'])")
    with subprocess.Popen([sys.executable, "-c", wrapper, "5", wrapper], env=os.environ | {TOKEN_ENV: token}) as proc:
        try:
            reads, missed = 0, 0
            while os.path.basename(os.readlink(f"/proc/{proc.pid}/exe")) != "sleep" or reads < 1000:
                reads += 1
                missed += not carries(proc.pid, token)
                assert reads < 10**6, "the wrapper never exec'd"
            assert missed == 0 and carries(proc.pid, token) and not carries(proc.pid, new_token())
            assert carrying(token) == [proc.pid]
        finally:
            proc.kill()
