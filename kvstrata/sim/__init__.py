"""Trace-driven simulation: Mooncake-format request traces, a synthetic generator, and replay.

Pure except :mod:`kvstrata.sim.traceio`, the one module that touches files.
"""

from kvstrata.sim.trace import (
    BLOCK_TOKENS,
    Request,
    TraceFormatError,
    parse_line,
    sort_by_time,
)

__all__ = ["BLOCK_TOKENS", "Request", "TraceFormatError", "parse_line", "sort_by_time"]
