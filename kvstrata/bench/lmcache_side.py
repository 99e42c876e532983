"""LMCache's side of ``kvstrata bench e2e``, in the venv that has LMCache, driven from the main
venv one turn at a time over a pipe: :class:`SideSession` starts the child and asks, :func:`serve`
answers in the child.

The protocol: one JSON line a request on the child's stdin (``{"index", "prompt",
"max_new_tokens", "tiers"}``), one JSON line an answer on its stdout (first ``{"ready": about}``,
then per request ``{"turns": {tier: figures}}`` or ``{"error": text}``). The child is
``python -m kvstrata.bench.lmcache_e2e --serve ...`` (that module's CLI), which imports kvstrata
as a package, as installed in LMCache's venv (``pip install -e .``; see :mod:`kvstrata.bench.lmcache`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:
    from kvstrata.bench.lmcache_session import LMCacheSession

CHILD_MODULE = "kvstrata.bench.lmcache_e2e"  # its ``main`` runs --serve


class SideSession:
    """An :class:`~kvstrata.bench.lmcache_session.LMCacheSession` in another interpreter (the venv
    that has LMCache), driven one turn at a time, so a benchmark can interleave LMCache's turns
    with its own.

    The child (``python -m kvstrata.bench.lmcache_e2e --serve ...``, :func:`serve`) answers one JSON line per
    request line on its stdout; everything LMCache and transformers print goes to its stderr
    (kept in a temporary file, whose tail an error names). Use as a context manager.

    Raises (from the constructor and :meth:`turn`):
        SideSessionError: the interpreter is missing, LMCache does not import there, the child
            failed or did not answer within ``timeout_s``.
    """

    def __init__(
        self, python_exe: str | os.PathLike[str], model_dir: str | os.PathLike[str], tiers: Iterable[str],
        capacity_tokens: int, chunk_tokens: int = 256, drop_page_cache: bool = True, timeout_s: float = 600.0,
    ) -> None:
        exe = Path(python_exe)
        if not exe.is_file() or not os.access(exe, os.X_OK):
            raise SideSessionError(f"no Python interpreter at {exe} (LMCache's venv: see kvstrata/bench/lmcache.py)")
        self.timeout_s = timeout_s
        self._stderr = tempfile.TemporaryFile(mode="w+")
        cmd = [str(exe), "-m", CHILD_MODULE, "--serve", "--model", str(model_dir),
               "--capacity-tokens", str(capacity_tokens), "--chunk-tokens", str(chunk_tokens)]
        for tier in tiers:
            cmd += ["--tier", tier]
        if not drop_page_cache:
            cmd.append("--keep-page-cache")
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      text=True, env=_side_env())
        try:
            self.about: dict[str, Any] = self._answer()["ready"]
        except BaseException:
            self.close()
            raise

    def turn(
        self, index: int, prompt: Sequence[int], max_new_tokens: int, tiers: Iterable[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        """LMCache's turn on ``prompt`` (see :meth:`LMCacheSession.turn`)."""
        request = {"index": index, "prompt": [int(t) for t in prompt], "max_new_tokens": max_new_tokens,
                   "tiers": None if tiers is None else list(tiers)}
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except OSError as exc:
            raise SideSessionError(f"the LMCache side ended: {exc}; {self._tail()}") from None
        return self._answer()["turns"]

    def _answer(self) -> dict[str, Any]:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            if not sel.select(self.timeout_s):
                raise SideSessionError(f"the LMCache side did not answer within {self.timeout_s:.0f} s; {self._tail()}")
        line = self._proc.stdout.readline()
        if not line:
            raise SideSessionError(f"the LMCache side exited ({self._proc.wait()}): {self._tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise SideSessionError(f"the LMCache side failed: {answer['error']}")
        return answer

    def _tail(self) -> str:
        self._stderr.seek(0)
        return _tail(self._stderr.read())

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()

    def __enter__(self) -> SideSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SideSessionError(RuntimeError):
    """The LMCache side could not run (the message says why)."""


def _side_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    env.setdefault("LMCACHE_TRACK_USAGE", "false")
    return env


def serve(session: LMCacheSession, requests: Any, answers: Any) -> None:
    """Answer each JSON request line of ``requests`` with one JSON line on ``answers``: first
    ``{"ready": ...}``, then per request ``{"turns": {tier: figures}}`` or ``{"error": text}``."""

    def send(obj: dict[str, Any]) -> None:
        answers.write(json.dumps(obj) + "\n")
        answers.flush()

    send({"ready": session.about()})
    for line in requests:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            turns = session.turn(int(request["index"]), request["prompt"], int(request["max_new_tokens"]),
                                 request.get("tiers"))
            send({"turns": turns})
        except Exception as exc:  # noqa: BLE001 - the caller reads it as one line
            send({"error": f"{type(exc).__name__}: {exc}"})


def _tail(text: str, lines: int = 8) -> str:
    return " | ".join(text.strip().splitlines()[-lines:]) or "(no output)"
