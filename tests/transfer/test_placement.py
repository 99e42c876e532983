"""kvstrata's threads compute alone: a thread started through ``io_thread_started`` runs its torch
ops on one OpenMP thread, and no other thread's count changes (the forward pass's, or one started
later). A second OpenMP team beside the forward's made vLLM's steps twice as long on 2 vCPUs."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from kvstrata.transfer.placement import io_thread_started  # noqa: E402


def _in_thread(first=None) -> int:
    """torch's thread count as seen in a new thread (after ``first``, if given)."""
    seen: list[int] = []

    def run() -> None:
        if first is not None:
            first()
        torch.ones(1 << 16).add_(1)  # a parallel op: the thread's OpenMP set-up has run
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_kvstrata_thread_runs_its_torch_ops_on_one_openmp_thread_and_no_other_thread_changes(two_threads):
    assert _in_thread() == 2  # a plain thread: the process's count
    assert _in_thread(io_thread_started) == 1
    assert torch.get_num_threads() == 2  # the calling (compute) thread untouched
    assert _in_thread() == 2  # ... and threads started later too (torch.set_num_threads would lower theirs)

