"""What runs on the lab's hosts: the pool (a Mooncake master and a daemon per port) on the pool
host, and a worker process (``kvstrata.lab.worker``) on each inference host.

Every process runs inside its host's namespace (``ip netns exec``) in its own session; ``Lab.close``
ends whatever is left in the namespaces, so a lab torn down by an error or Ctrl-C leaves none.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.lab.netns import Lab, LabError
from kvstrata.pool import embedded
from kvstrata.pool.config import PoolConfig, make_secret

MASTER_PORT, METRICS_PORT, DAEMON_PORT, SEGMENT_PORT = 50051, 50052, 50060, 17000
WORKER_TIMEOUT_S = 600.0  # the longest one worker command may take (a 1 GiB restore at 0.1 Gbit/s: ~90 s)


@dataclass(frozen=True)
class LabPool:
    """The pool as a client on ``host`` reaches it: ``config(host)``."""

    master: str
    segments: tuple[str, ...]  # one daemon per pool port, named by its address there
    secret_file: str
    lab: Lab

    def config(self, host: str, segments: tuple[str, ...] | None = None) -> PoolConfig:
        """How ``host`` reaches the pool: by its own address toward the pool, its puts spread over
        ``segments`` (default: every daemon it reaches through a port of its own)."""
        spec = self.lab.spec
        switch = spec.reachable_switch(host, spec.pool.name)
        if segments is None:
            mine = [spec.bridged(p.switch) for p in spec.host(host).ports]
            segments = tuple(seg for seg, p in zip(self.segments, spec.pool.ports) if any(p.switch in m for m in mine))
        return PoolConfig(master=self.master, local_hostname=spec.address(host, switch), secret_file=self.secret_file,
                          segments=segments)


def start_pool(lab: Lab, run_dir: Path, segment_bytes: int) -> LabPool:
    """A master on the pool host's first port and a daemon on each of its ports (``segment_bytes``
    each), inside the pool host's namespace; they end with the lab."""
    spec = lab.spec
    pool = spec.pool
    prefix = lab.exec_prefix(pool.name)
    master_host = spec.address(pool.name, pool.ports[0].switch)
    master = f"{master_host}:{MASTER_PORT}"

    def accepting(address: str, timeout_s: float) -> bool:
        return lab.run_in(pool.name, lambda: embedded.accepts(address, timeout_s))

    log = run_dir / "master.log"
    proc = embedded.launch_master(master_host, MASTER_PORT, METRICS_PORT, log, prefix)
    embedded.wait_for(master, proc, log, accepting)
    segments = []
    for j, port in enumerate(pool.ports):
        address = spec.address(pool.name, port.switch)
        segment = f"{address}:{SEGMENT_PORT + j}"  # the daemon's segment name is exactly its --host
        log = run_dir / f"daemon{j}.log"
        proc = embedded.launch_daemon(segment, DAEMON_PORT + j, master, segment_bytes, log, prefix)
        embedded.wait_for(f"{address}:{DAEMON_PORT + j}", proc, log, accepting)
        segments.append(segment)
    secret = run_dir / "pool.key"
    make_secret(secret)
    return LabPool(master, tuple(segments), str(secret), lab)


class WorkerProcess:
    """A ``kvstrata.lab.worker`` in ``host``'s namespace: ``send`` a command, ``receive`` its answer."""

    def __init__(self, lab: Lab, host: str, setup: dict[str, Any], log: Path) -> None:
        self.host = host
        self._log = log
        with open(log, "wb") as err:
            self._proc = subprocess.Popen(
                [*lab.exec_prefix(host), sys.executable, "-m", "kvstrata.lab.worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
            )
        self.send(setup)
        ready = self.receive()
        self.block_bytes = int(ready["block_bytes"])

    def send(self, command: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(command) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise LabError(f"lab worker on {self.host} exited: {self._tail()}") from None

    def receive(self, timeout_s: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
        """The next answer; LabError naming the host when it failed, exited or took too long."""
        assert self._proc.stdout is not None
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(self._proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not got:
            self._proc.kill()
            raise LabError(f"lab worker on {self.host} did not answer within {timeout_s:g} s")
        if not got[0]:
            raise LabError(f"lab worker on {self.host} exited: {self._tail()}")
        answer = json.loads(got[0])
        if "error" in answer:
            raise LabError(f"lab worker on {self.host}: {answer['error']}")
        return answer

    def ask(self, command: dict[str, Any]) -> float:
        self.send(command)
        return float(self.receive()["seconds"])

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self._proc.wait(timeout=30)
            except (LabError, subprocess.TimeoutExpired, OSError):
                self._proc.kill()
                self._proc.wait()

    def _tail(self) -> str:
        self._proc.wait()
        try:
            lines = [ln for ln in self._log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return (lines[-1] if lines else "(no log)") + f" (exit {self._proc.returncode})"
