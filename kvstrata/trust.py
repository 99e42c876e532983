"""Directories and files kvstrata trusts: made by it, owned by its user, private, no symlinks.

A directory that holds KV (a disk tier), a pool's run state (``pool.json``, ``pool.key``) or a
socket the engine talks through is trusted only if it is this user's: owned by the effective
uid, not a symlink (checked with ``lstat``), and open to nobody else. One another local user
created first, or a symlink planted in its place, is refused in one line that names the path
and its owner; kvstrata never chmods or follows someone else's.

Pure standard library; no state.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


class Untrusted(ValueError):
    """A path kvstrata would trust is not this user's alone (the message names path and owner)."""


def owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def check_private_dir(path: Path, what: str = "directory") -> None:
    """Raise :class:`Untrusted` unless ``path`` is a real directory owned by this user with no
    group or other permission bits."""
    _check_own(path, what, stat.S_ISDIR, "a directory", "chmod 700 it")


def _check_own(path: Path, what: str, kind, kind_text: str, fix: str) -> os.stat_result:
    """``path``'s ``lstat`` if it is of ``kind``, no symlink, this user's, and private; else :class:`Untrusted`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise Untrusted(f"{what} {path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise Untrusted(f"{what} {path} is a symlink (owner {owner_name(st.st_uid)}): refusing to follow it")
    if not kind(st.st_mode):
        raise Untrusted(f"{what} {path} is not {kind_text}")
    if st.st_uid != os.geteuid():
        raise Untrusted(f"{what} {path} is owned by {owner_name(st.st_uid)}, not {owner_name(os.geteuid())}: "
                        "refusing to trust it (remove it, or choose another path)")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise Untrusted(f"{what} {path} is open to others (mode {stat.S_IMODE(st.st_mode):o}): {fix}")
    return st


def private_dir(path: str | os.PathLike[str], what: str = "directory") -> Path:
    """``path`` as a private directory of this user: created 0700 (parents as ``mkdir -p``
    makes them) if absent; an existing one of this user's is tightened to 0700; one of another
    user's, or a symlink, is refused (:class:`Untrusted`)."""
    path = Path(path)
    try:
        os.mkdir(path, DIR_MODE)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid():
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, DIR_MODE)  # ours: tighten it (block files hold users' prompts)
    check_private_dir(path, what)
    return path


def check_private_file(path: Path, what: str = "file") -> os.stat_result:
    """Raise :class:`Untrusted` unless ``path`` is a regular file (no symlink) owned by this
    user with no group or other bits; returns its ``lstat``."""
    return _check_own(path, what, stat.S_ISREG, "a regular file", "chmod 600 it")


def open_private(path: str | os.PathLike[str], flags: int, mode: int = FILE_MODE) -> int:
    """``os.open`` that never follows a symlink at ``path`` and refuses a file of another user's;
    a file it creates is ``mode`` (0600), and one of this user's that is wider is tightened to it.

    Raises:
        Untrusted: ``path`` is a symlink, or another user's file.
        OSError: as ``os.open`` (e.g. FileNotFoundError without ``O_CREAT``).
    """
    # O_TRUNC only once the file is known to be this user's: the open itself would truncate
    # another user's file (root may open anyone's) before its owner could be checked.
    truncate = flags & os.O_TRUNC
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as error:
        if error.errno != errno.ELOOP:  # O_NOFOLLOW's answer for a symlink (dangling or not)
            raise
        raise Untrusted(f"file {path} is a symlink: refusing to follow it") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise Untrusted(f"file {path} is owned by {owner_name(st.st_uid)}, not {owner_name(os.geteuid())}: "
                            "refusing to trust it")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, mode)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_own(path: str | os.PathLike[str], what: str = "file") -> int:
    """``path`` opened for reading if it is a regular file of this user's, never followed
    through a symlink (its mode is the caller's to check: ``fstat`` the descriptor).

    Raises:
        Untrusted: a symlink, another user's file, or no regular file (a FIFO, a directory).
        OSError: as ``os.open`` (FileNotFoundError: there is none).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise Untrusted(f"{what} {path} is a symlink: refusing to follow it") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by {owner_name(st.st_uid)}, not {owner_name(os.geteuid())}: refusing to trust it"
    else:
        return fd
    os.close(fd)
    raise Untrusted(f"{what} {path} {problem}")
