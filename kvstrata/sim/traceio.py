"""Reading and writing trace files: the simulator's only I/O."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from kvstrata.sim.trace import Request, TraceFormatError, parse_line


def read_trace(path: str | os.PathLike) -> list[Request]:
    """Every request of a Mooncake-format JSON-lines trace, in file order; blank lines skipped.

    Raises:
        FileNotFoundError: no such file (the message names it).
        TraceFormatError: a bad line; the message names the file, the line and the field.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"trace {os.fspath(path)!r}: no such file")
    requests = []
    with open(path, encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                requests.append(parse_line(text, line_no))
            except TraceFormatError as exc:
                raise TraceFormatError(f"trace {os.fspath(path)!r}, {exc}") from None
    return requests


def write_trace(path: str | os.PathLike, requests: Iterable[Request]) -> int:
    """Write requests as Mooncake-format JSON lines; returns how many were written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for request in requests:
            f.write(json.dumps(request.to_json()) + "\n")
            n += 1
    return n
