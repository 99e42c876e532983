"""The model and the host as a serving run sees them before it starts (an edge: it reads a
model's ``config.json`` and ``/proc/stat``): the model's vocabulary and KV bytes per token, and a
wait for the host's CPUs to go quiet, which ``bench serve`` does before each phase and
``calibrate --engine vllm`` before each set of points (a server answering ``/health`` still has
start-up work in hand; a worker busy-polls after its last step).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelFacts:
    """What a serving run needs of the model before any server starts (read from its config.json)."""

    vocab: int
    bytes_per_token: int  # KV of one token, every layer, K and V


def model_facts(model_dir: Path, dtype: str) -> ModelFacts:
    """The model's vocabulary size and KV bytes per token served as ``dtype``.

    Raises:
        ValueError: no usable config.json (the message names it).
    """
    from kvstrata.kv.presets import load_geometry

    config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not isinstance(vocab, int):
        raise ValueError(f"{model_dir}/config.json: no vocab_size to draw prompts from")
    return ModelFacts(vocab, load_geometry(str(model_dir), dtype).bytes_per_token)


QUIET_BUSY = 0.25  # the host's CPUs at most this busy over QUIET_WINDOW_S: quiet
QUIET_WINDOW_S = 0.5
QUIET_WAIT_S = 20.0


def wait_quiet() -> float:
    """Wait until the host's CPUs are at most ``QUIET_BUSY`` busy over ``QUIET_WINDOW_S``
    (``/proc/stat``), ``QUIET_WAIT_S`` at most; the seconds waited (0 where there is no ``/proc/stat``)."""
    begin = time.perf_counter()
    while time.perf_counter() - begin < QUIET_WAIT_S:
        before = _cpu_ticks()
        time.sleep(QUIET_WINDOW_S)
        after = _cpu_ticks()
        if before is None or after is None or after[1] <= before[1]:
            break
        if (after[0] - before[0]) / (after[1] - before[1]) <= QUIET_BUSY:
            break
    return time.perf_counter() - begin


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, all) ticks of every CPU so far, from ``/proc/stat``; None where there is none.
    Busy: user, nice, system, irq, softirq; all: those and idle and iowait."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 7:
        return None
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
    return busy, busy + fields[3] + fields[4]
