"""kvstrata.trust: a directory or file of another user's, or a symlink planted in its place, is
refused in one line naming path and owner, and nothing is written through it; this user's own
are made or tightened to 0700 / 0600.

Another user is emulated as root does it: the test chowns what it made to ``nobody``."""

from __future__ import annotations

import os
import pwd
import stat

import pytest

from kvstrata import trust
from kvstrata.trust import Untrusted

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="handing a file to another user needs root")


def give_to_nobody(path) -> None:
    nobody = pwd.getpwnam("nobody")
    os.chown(path, nobody.pw_uid, nobody.pw_gid, follow_symlinks=False)


def test_a_new_private_dir_is_made_0700_with_its_parents(tmp_path):
    made = trust.private_dir(tmp_path / "a" / "b")
    assert made == tmp_path / "a" / "b" and stat.S_IMODE(made.stat().st_mode) == 0o700


def test_this_users_own_wide_directory_is_tightened(tmp_path):
    wide = tmp_path / "wide"
    wide.mkdir(mode=0o755)
    wide.chmod(0o777)
    trust.private_dir(wide)
    assert stat.S_IMODE(wide.stat().st_mode) == 0o700
    trust.check_private_dir(wide)


def test_another_users_directory_is_refused_and_left_as_it_is(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    theirs.chmod(0o777)
    give_to_nobody(theirs)
    with pytest.raises(Untrusted, match=f"pool run directory {theirs} is owned by nobody, not root"):
        trust.private_dir(theirs, "pool run directory")
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o777  # not chmodded: it is not ours to change
    with pytest.raises(Untrusted, match="owned by nobody"):
        trust.check_private_dir(theirs)


def test_a_symlink_in_place_of_a_directory_is_refused_not_followed(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o755)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(Untrusted, match=f"directory {link} is a symlink"):
        trust.private_dir(link)
    assert stat.S_IMODE(target.stat().st_mode) == 0o755  # its target not chmodded either


def test_a_file_where_a_directory_should_be_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(Untrusted, match="is not a directory"):
        trust.private_dir(tmp_path / "file")


def test_check_private_file_refuses_symlinks_other_owners_and_wide_modes(tmp_path):
    own = tmp_path / "own"
    own.write_text("x")
    own.chmod(0o600)
    assert trust.check_private_file(own).st_size == 1
    link = tmp_path / "link"
    link.symlink_to(own)
    with pytest.raises(Untrusted, match="is a symlink"):
        trust.check_private_file(link)
    own.chmod(0o640)
    with pytest.raises(Untrusted, match="open to others"):
        trust.check_private_file(own)
    own.chmod(0o600)
    give_to_nobody(own)
    with pytest.raises(Untrusted, match="owned by nobody"):
        trust.check_private_file(own)


@pytest.mark.parametrize("dangling", [False, True])
def test_open_private_writes_nothing_through_a_symlink(tmp_path, dangling):
    target = tmp_path / "victim"
    if not dangling:
        target.write_text("precious")
        target.chmod(0o644)
    link = tmp_path / "master.log"
    link.symlink_to(target)
    with pytest.raises(Untrusted, match=f"file {link} is a symlink"):
        trust.open_private(link, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    if dangling:
        assert not target.exists()  # not created through the link
    else:
        assert target.read_text() == "precious" and stat.S_IMODE(target.stat().st_mode) == 0o644


def test_open_private_neither_truncates_nor_chmods_another_users_file(tmp_path):
    theirs = tmp_path / "daemon.log"
    theirs.write_text("their bytes")
    theirs.chmod(0o644)
    give_to_nobody(theirs)
    with pytest.raises(Untrusted, match="owned by nobody"):
        trust.open_private(theirs, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert theirs.read_text() == "their bytes" and stat.S_IMODE(theirs.stat().st_mode) == 0o644


def test_open_private_creates_0600_and_tightens_and_truncates_this_users_own(tmp_path):
    path = tmp_path / "log"
    os.close(trust.open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text("old")
    path.chmod(0o644)
    os.close(trust.open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
    assert path.read_text() == "" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_open_own_reads_this_users_regular_files_only(tmp_path):
    own = tmp_path / "pool.json"
    own.write_text("{}")
    with os.fdopen(trust.open_own(own)) as file:
        assert file.read() == "{}"
    link = tmp_path / "link"
    link.symlink_to(own)
    with pytest.raises(Untrusted, match=f"state {link} is a symlink"):
        trust.open_own(link, "state")
    os.mkfifo(tmp_path / "fifo")  # opened without blocking, then refused
    with pytest.raises(Untrusted, match="is not a regular file"):
        trust.open_own(tmp_path / "fifo")
    give_to_nobody(own)
    with pytest.raises(Untrusted, match="owned by nobody"):
        trust.open_own(own)
    with pytest.raises(FileNotFoundError):
        trust.open_own(tmp_path / "none")
