"""The scheduler's lookup channel: plain numbers only, this user's only, bounded in time.

A real worker process answers (a child Python serving a fixed answer); attacks come from a
directory or socket of another user (``nobody``) and from a process running as ``nobody``.
"""

from __future__ import annotations

import os
import pickle
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvstrata.integrations.vllm import channel
from kvstrata.integrations.vllm.channel import LookupServer, WorkerLookup
from kvstrata.media import Medium
from kvstrata.trust import Untrusted

BS = 4
ANSWER = (Medium.HOST, Medium.HOST, Medium.DISK)

_CHILD = textwrap.dedent("""
    import sys, time
    from kvstrata.integrations.vllm.channel import LookupServer
    from kvstrata.media import Medium
    answer = lambda tokens: (Medium.HOST, Medium.HOST, Medium.DISK)[: len(tokens) // 4]
    server = LookupServer(sys.argv[1], answer)
    print("up", flush=True)
    sys.stdin.read()
    server.close()
""")


@pytest.fixture
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    base = tmp_path / "run"
    base.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    return base


def _nobody() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this host")


@pytest.fixture
def worker(runtime_dir: Path):
    """A worker process serving the lookup for engine 'eng'."""
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime_dir))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, "eng"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


@pytest.mark.server  # a worker serving the channel in another process
def test_a_worker_in_another_process_answers_in_plain_numbers(worker: subprocess.Popen) -> None:
    lookup = WorkerLookup("eng")
    assert lookup.hit_tiers(list(range(12)), BS) == ANSWER
    assert lookup.hit_tiers(list(range(8)), BS) == ANSWER[:2]  # the same connection, again
    lookup.close()
    path = channel.socket_path("eng")
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_worker_in_this_process_is_asked_directly(runtime_dir: Path) -> None:
    server = LookupServer("local", lambda tokens: (Medium.DEVICE,) * (len(tokens) // BS))
    try:
        assert WorkerLookup("local").hit_tiers(list(range(8)), BS) == (Medium.DEVICE, Medium.DEVICE)
    finally:
        server.close()
    assert WorkerLookup("local").hit_tiers(list(range(8)), BS) == ()  # gone: a miss


def test_no_worker_is_a_miss_at_once(runtime_dir: Path) -> None:
    start = time.monotonic()
    assert WorkerLookup("absent").hit_tiers(list(range(8)), BS) == ()
    assert time.monotonic() - start < 0.1


def test_a_hung_worker_costs_the_budget_once_and_a_miss(runtime_dir: Path) -> None:
    path = channel.socket_path("hung")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)  # accepts into the backlog, never answers
    try:
        lookup = WorkerLookup("hung", budget_s=0.1)
        start = time.monotonic()
        assert lookup.hit_tiers(list(range(8)), BS) == ()
        took = time.monotonic() - start
        assert 0.09 <= took < 0.5, took
        assert lookup.timeouts == 1
    finally:
        listener.close()


def test_a_directory_another_user_made_first_is_refused(runtime_dir: Path) -> None:
    nobody = _nobody()
    planted = runtime_dir / f"kvstrata-{os.geteuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(Untrusted, match=r"owned by nobody"):
        LookupServer("eng", lambda tokens: ())
    lookup = WorkerLookup("eng")
    assert lookup.hit_tiers(list(range(8)), BS) == ()  # a miss, never the planted socket's word
    assert "owned by nobody" in (lookup.last_error or "")


def test_a_symlinked_directory_is_refused(runtime_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (runtime_dir / f"kvstrata-{os.geteuid()}").symlink_to(elsewhere)
    with pytest.raises(Untrusted, match="symlink"):
        LookupServer("eng", lambda tokens: ())


def test_a_socket_file_of_another_owner_is_never_used(runtime_dir: Path) -> None:
    nobody = _nobody()
    path = channel.socket_path("eng")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    os.chown(path, nobody.pw_uid, nobody.pw_gid)
    try:
        lookup = WorkerLookup("eng")
        assert lookup.hit_tiers(list(range(8)), BS) == ()
        assert lookup.refused == 1
        with pytest.raises(Untrusted, match="owned by nobody"):
            LookupServer("eng", lambda tokens: ())  # nor replaced
    finally:
        listener.close()


def test_another_users_process_gets_no_answer_and_no_pickle_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even with the directory opened up, a process of another user is dropped unanswered, and
    what it sends is never unpickled."""
    nobody = _nobody()
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for the other user")
    base = Path(tempfile.mkdtemp(prefix="kvstrata-test-"))  # under /tmp: the other user can walk to it
    os.chmod(base, 0o711)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    try:
        _attack_as(nobody, python, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _attack_as(nobody: pwd.struct_passwd, python: str, tmp_path: Path) -> None:
    asked = threading.Event()
    server = LookupServer("eng", lambda tokens: (asked.set(), ())[1])
    path = channel.socket_path("eng")
    os.chmod(path.parent, 0o711)  # as if the attacker could reach it anyway
    os.chmod(path, 0o666)
    marker = tmp_path / "pwned"
    os.chmod(tmp_path, 0o777)

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Boom()).hex()
    attacker = textwrap.dedent(f"""
        import socket, struct
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect({str(path)!r})
        s.settimeout(3)
        try:
            s.sendall(bytes.fromhex({payload!r}))
            s.sendall(b"KVL1" + struct.pack("<I", 2) + struct.pack("<2I", 1, 2))
            print("answer", s.recv(64))
        except OSError as e:
            print("dropped", type(e).__name__)
    """)
    try:
        out = subprocess.run([python, "-c", attacker], user=nobody.pw_uid, group=nobody.pw_gid, capture_output=True,
                             text=True, timeout=20, cwd="/")
        assert out.returncode == 0, out.stderr
        assert "answer b''" in out.stdout or "dropped" in out.stdout, out.stdout
        time.sleep(0.2)
        assert not marker.exists()
        assert not asked.is_set()
    finally:
        server.close()


@pytest.mark.server  # a worker serving the channel in another process
def test_malformed_requests_drop_the_connection_and_the_server_serves_on(worker: subprocess.Popen) -> None:
    path = channel.socket_path("eng")
    bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bad.connect(str(path))
    bad.settimeout(3)
    bad.sendall(pickle.dumps(["not", "numbers"]))
    assert _closed_unanswered(bad)
    bad.close()
    huge = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    huge.connect(str(path))
    huge.settimeout(3)
    huge.sendall(b"KVL1" + (channel.MAX_TOKENS + 1).to_bytes(4, "little"))
    assert _closed_unanswered(huge)
    huge.close()
    assert WorkerLookup("eng").hit_tiers(list(range(12)), BS) == ANSWER


def _closed_unanswered(sock: socket.socket) -> bool:
    try:
        return sock.recv(16) == b""
    except ConnectionResetError:  # closed with our bytes unread
        return True


def test_an_answer_longer_than_the_question_is_refused(runtime_dir: Path) -> None:
    path = channel.socket_path("liar")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def lie() -> None:
        conn, _ = listener.accept()
        channel.read_request(conn)
        conn.sendall(channel.encode_answer((Medium.HOST,) * 9))
        time.sleep(0.5)
        conn.close()

    threading.Thread(target=lie, daemon=True).start()
    try:
        lookup = WorkerLookup("liar")
        assert lookup.hit_tiers(list(range(8)), BS) == ()
        assert "9 blocks" in (lookup.last_error or "")
    finally:
        listener.close()
