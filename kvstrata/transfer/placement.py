"""Where kvstrata's own threads run in a process that computes, and what CPU time they used.

An engine on CPUs binds its compute to a set of cores (vLLM: ``VLLM_CPU_OMP_THREADS_BIND``, one
list per TP rank); every thread its worker process starts afterwards inherits that binding. Left
there, kvstrata's transfer threads (stores, write-downs to disk and the pool, checksums) would
take their time from the forward pass on the very cores it runs on. So, as vLLM's NIXL
connector reserves a core per NUMA node for KV transfer, a process may name I/O CPUs
(:func:`place_io_threads`), and every kvstrata thread moves itself there when it starts
(:func:`io_thread_started`, the initializer of the transfer worker's pools and the first call of
every other thread kvstrata starts). Without a placement nothing moves.

Wherever they run, kvstrata's threads compute alone: each runs its torch ops on one OpenMP
thread (:func:`io_thread_started` sets the calling thread's OpenMP limit, nobody else's). A
thread that runs a parallel torch op (a copy of a block's 32K elements or more is one) starts an
OpenMP team of its own beside the forward pass's; GNU OpenMP, seeing more of its threads than
CPUs, stops spinning between parallel regions, and the forward's many short regions then wait on
their workers' wake-ups: on 2 vCPUs, vLLM's step took twice as long with a save thread beside it.

The same hook records each thread's native id, so the CPU time kvstrata's threads used can be
read back from ``/proc`` (:func:`io_threads_cpu_s`): what the connector cost, apart from the
compute it sits beside.
"""

from __future__ import annotations

import os
import sys
import threading

_lock = threading.Lock()
_io_cpus: frozenset[int] | None = None
_threads: set[int] = set()  # native ids of kvstrata threads started in this process
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,8,10-11"`` as a set of CPU ids.

    Raises:
        ValueError: the text is not such a list.
    """
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r}")
        a, b = int(first), int(last or first)
        if b < a:
            raise ValueError(f"not a CPU list: {text!r}")
        cpus.update(range(a, b + 1))
    return frozenset(cpus)


def io_cpus_for(setting: str) -> frozenset[int] | None:
    """The CPUs kvstrata's threads in a vLLM worker go to, by the ``io_cpus`` setting: ``"none"``:
    None (where the worker puts them); a CPU list: those; ``"auto"``: the CPUs this process may
    use (its parent's, the engine core's, before vLLM bound this worker) less every TP rank's
    compute (``VLLM_CPU_OMP_THREADS_BIND``: a CPU list per rank, ``|``-separated;
    ``auto``/``nobind``/unset: this worker's own binding), None where none are left."""
    if setting == "none" or not hasattr(os, "sched_getaffinity"):
        return None
    if setting != "auto":
        return parse_cpu_list(setting)
    own = frozenset(os.sched_getaffinity(0))
    try:
        available = frozenset(os.sched_getaffinity(os.getppid())) | own
    except OSError:
        available = own
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    try:
        lists = [parse_cpu_list(part) for part in bind.split("|")] if bind not in ("", "auto", "nobind") else []
    except ValueError:
        lists = []
    compute = frozenset().union(*lists) if lists and all(lists) else own
    return (available - compute) or None


def place_io_threads(cpus: frozenset[int] | None) -> None:
    """From now on kvstrata's threads in this process run on ``cpus`` (None: where they start)."""
    global _io_cpus
    with _lock:
        _io_cpus = cpus


def io_thread_started() -> None:
    """First call of every kvstrata thread: move to the I/O CPUs (if placed), compute alone (one
    OpenMP thread for its torch ops), be counted."""
    _compute_alone()
    with _lock:
        _threads.add(threading.get_native_id())
        cpus = _io_cpus
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)  # 0: this thread (Linux)
        except OSError:
            pass  # a CPU outside this process's cgroup: stay where it started


def _compute_alone() -> None:
    """This thread's torch ops on this thread only (its OpenMP limit 1; other threads' untouched:
    ``torch.set_num_threads`` would also lower every thread started after it)."""
    torch = sys.modules.get("torch")
    if torch is None:  # nothing here computes with torch
        return
    from threadpoolctl import threadpool_limits

    torch.get_num_threads()  # torch's own per-thread set-up first: it would set the process's count over ours
    threadpool_limits(1, user_api="openmp")


def io_threads_cpu_s() -> float:
    """CPU seconds (user + system) the kvstrata threads of this process have used (those alive
    now; Linux ``/proc``, else 0)."""
    total = 0
    with _lock:
        tids = list(_threads)
    gone = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            gone.append(tid)
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    if gone:
        with _lock:
            _threads.difference_update(gone)
    return total * _TICK_S
