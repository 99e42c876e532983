"""CUDA streams of the transfer worker's threads: one per thread per device, made on first use.

A handler that touches a GPU tier runs on its thread's own stream, which first waits for what
the submitting thread had queued on its current stream (``ready``: a CUDA event, or one per
device), and is synchronized before the handler's results are reported, so reported bytes are
in place. Without a CUDA device nothing here touches CUDA.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext

import torch

ReadyEvents = dict[torch.device, torch.cuda.Event]
"""Per CUDA device, the event recorded on the submitting thread's current stream."""


class _ThreadStreams(threading.local):
    """Per thread (``threading.local`` runs ``__init__`` once in each thread that touches it):
    its streams by device."""

    def __init__(self) -> None:
        self.by_device: dict[torch.device, torch.cuda.Stream] = {}


class StreamsByThread:
    """Each thread's own CUDA stream per device, created lazily (a thread that never touches a
    GPU tier makes none)."""

    def __init__(self) -> None:
        self._local = _ThreadStreams()

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """This thread's stream on ``device``, made on first use."""
        streams = self._local.by_device
        if device not in streams:
            streams[device] = torch.cuda.Stream(device=device)
        return streams[device]

    def scope(self, device: torch.device | None,
              ready: ReadyEvents | torch.cuda.Event | None) -> AbstractContextManager[None]:
        """Run the block on this thread's stream of ``device`` after ``ready`` (the device's
        event where ``ready`` has one per device), synchronized on exit; nothing without a device."""
        if device is None:
            return nullcontext()
        return _StreamScope(self.stream(device), ready.get(device) if isinstance(ready, dict) else ready)


def record_ready(devices: set[torch.device]) -> ReadyEvents | None:
    """An event on the calling thread's current stream of each CUDA device in ``devices``; None
    without any."""
    return {d: torch.cuda.current_stream(d).record_event() for d in devices} or None


class _StreamScope:
    """Run on ``stream`` after ``ready``; synchronize on exit, even on failure (no copy may
    still be landing in a slot the caller releases)."""

    def __init__(self, stream: torch.cuda.Stream, ready: torch.cuda.Event | None) -> None:
        self._stream, self._ready = stream, ready
        self._scope = torch.cuda.stream(stream)

    def __enter__(self) -> None:
        if self._ready is not None:
            self._stream.wait_event(self._ready)
        self._scope.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self._scope.__exit__(*exc)
        finally:
            self._stream.synchronize()
