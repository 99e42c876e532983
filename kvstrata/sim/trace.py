"""Requests in Mooncake's trace format, and the parsing of one JSON line into one.

A trace is JSON lines, one request each::

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, ..., 78]}

``timestamp`` is the arrival in milliseconds; ``hash_ids`` are *chained* ids of 512-token blocks:
a request's k-th id stands for its first k blocks (the whole prefix, not the block alone), so two
requests share a leading id run exactly as far as they share a prefix.

What is an error and what is allowed (every error names the line and the field):

* errors: not JSON, not an object, a missing field, a field of the wrong type (bools are not
  ints), a negative ``timestamp``/``input_length``/``output_length``, ``hash_ids`` longer than
  ``ceil(input_length / 512)`` (more blocks than tokens to fill them), an id repeated within one
  request (a chained id names one prefix length, so it cannot recur).
* allowed: ``hash_ids`` shorter than the block count (a trace may leave a tail unhashed; those
  tokens simply never hit), a partial last block, ``output_length`` 0, unknown extra fields
  (ignored), negative ids (ids are opaque), timestamps out of order (see :func:`sort_by_time`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

BLOCK_TOKENS = 512  # tokens per hashed block in Mooncake's traces


class TraceFormatError(ValueError):
    """A trace line that does not describe a request; the message names the line and field."""


@dataclass(frozen=True)
class Request:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival time in milliseconds from the trace's start.
        input_length: prompt tokens.
        output_length: generated tokens.
        hash_ids: chained block ids; ``hash_ids[k]`` names the first ``k + 1`` blocks of
            ``BLOCK_TOKENS`` tokens. At most ``ceil(input_length / BLOCK_TOKENS)`` of them.
    """

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("timestamp_ms", "input_length", "output_length"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if len(self.hash_ids) > max_blocks(self.input_length):
            raise ValueError(
                f"hash_ids has {len(self.hash_ids)} ids but input_length {self.input_length} "
                f"fills at most {max_blocks(self.input_length)} blocks of {BLOCK_TOKENS}"
            )
        if len(set(self.hash_ids)) != len(self.hash_ids):
            raise ValueError(
                "hash_ids repeats an id (a chained id names one prefix length)"
            )

    def to_json(self) -> dict:
        """The request as a Mooncake trace object (field order as in Mooncake's traces)."""
        return {
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }


def max_blocks(input_length: int) -> int:
    """Blocks ``input_length`` tokens occupy: ``ceil(input_length / BLOCK_TOKENS)``."""
    return -(-input_length // BLOCK_TOKENS)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_line(text: str, line_no: int) -> Request:
    """Parse one trace line.

    Args:
        text: the line's text (JSON object).
        line_no: its 1-based line number, for the error message.

    Raises:
        TraceFormatError: naming ``line N`` and the offending field.
    """

    def fail(field: str | None, why: str) -> TraceFormatError:
        where = f"line {line_no}" + (f": field {field!r}" if field else "")
        return TraceFormatError(f"{where}: {why}")

    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail(None, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(doc, dict):
        raise fail(None, f"expected a JSON object, got {type(doc).__name__}")
    values = {}
    for field in ("timestamp", "input_length", "output_length"):
        if field not in doc:
            raise fail(field, "missing")
        value = doc[field]
        if not _is_int(value):
            raise fail(field, f"must be an integer, got {value!r}")
        if value < 0:
            raise fail(field, f"must be non-negative, got {value}")
        values[field] = value
    if "hash_ids" not in doc:
        raise fail("hash_ids", "missing")
    ids = doc["hash_ids"]
    if not isinstance(ids, list):
        raise fail("hash_ids", f"must be a list of integers, got {type(ids).__name__}")
    for i, block_id in enumerate(ids):
        if not _is_int(block_id):
            raise fail("hash_ids", f"element {i} must be an integer, got {block_id!r}")
    limit = max_blocks(values["input_length"])
    if len(ids) > limit:
        raise fail(
            "hash_ids",
            f"{len(ids)} ids but input_length {values['input_length']} fills at most {limit} "
            f"blocks of {BLOCK_TOKENS} tokens",
        )
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        dup = next(b for b in ids if b in seen or seen.add(b))
        raise fail(
            "hash_ids", f"id {dup} repeats (a chained id names one prefix length)"
        )
    return Request(
        values["timestamp"], values["input_length"], values["output_length"], tuple(ids)
    )


def sort_by_time(requests: Iterable[Request]) -> list[Request]:
    """Requests in arrival order; a stable sort, so ties keep their trace order."""
    return sorted(requests, key=lambda r: r.timestamp_ms)
