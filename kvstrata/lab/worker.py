"""An inference host of the lab: a process in that host's namespace that restores KV from the pool
through the real cache, on the lab's command.

Run as ``python -m kvstrata.lab.worker`` (by ``kvstrata.lab.run``, under ``ip netns exec``); it
speaks JSON lines: stdin carries commands, stdout one answer per command, stderr the pool
engine's log. The first line sets it up; it then stores its blocks in the pool (through a
``RemoteTier``, sealed with the pool's secret as a cache's are) and answers ``{"ready": ...}``.

Commands, each answered with ``{"seconds": s}`` (or ``{"error": "..."}``, then it exits 1):

- ``{"op": "restore", "path": "direct" | "staged", "blocks": n}``: ``TieredCache.load`` of the first
  ``n`` blocks, found in the pool only, to the device tier, by that path (see
  ``kvstrata.calibrate.poolcache``), verified byte for byte (untimed);
- ``{"op": "copy", "bytes": n}``: one torch copy of ``n`` bytes, as a load copies host -> device on
  a CPU stand-in (the staged restore's second hop);
- ``{"op": "quit"}``: close the caches and exit 0 (the objects stay in the pool).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import torch

from kvstrata.calibrate.kvdata import random_kv
from kvstrata.calibrate.ours_remote import OursRemote
from kvstrata.calibrate.poolcache import PoolReader
from kvstrata.cache import CacheConfig
from kvstrata.calibrate.probes import one_torch_copy
from kvstrata.index.keys import block_keys
from kvstrata.kv import load_geometry
from kvstrata.kv.layout import KVLayout
from kvstrata.media import FetchPath
from kvstrata.pool.config import PoolConfig, RemoteMode, read_secret

POOL_TIMEOUT_S = 120.0  # one pool call of up to 256 MiB over a link shaped down to 0.1 Gbit/s: ~22 s


@dataclasses.dataclass(frozen=True)
class WorkerSetup:
    """The first line a worker reads.

    Attributes:
        pool: where the pool is, as this host reaches it (``local_hostname``: its own address).
        model: a model preset or config: the KV geometry.
        block_tokens: tokens per block.
        blocks: how many blocks to store (the largest restore).
        tag: this worker's model id suffix: its blocks' namespace (two workers store apart).
        workers: the cache's transfer threads.
    """

    pool: dict[str, Any]
    model: str
    block_tokens: int
    blocks: int
    tag: str
    workers: int = 2

    def layout(self) -> KVLayout:
        return KVLayout.from_geometry(load_geometry(self.model), self.block_tokens)


class Worker:
    def __init__(self, setup: WorkerSetup) -> None:
        self.layout = setup.layout()
        pool = PoolConfig(**setup.pool)
        self.tokens, self.kv = random_kv(self.layout, setup.blocks, torch.device("cpu"))
        self.base = CacheConfig(
            layout=self.layout, model_id=f"kvstrata-lab/{setup.tag}", device_bytes=self.layout.block_bytes,
            host_bytes=0, workers=setup.workers, device="cpu", pool=pool,
            remote_bytes=setup.blocks * self.layout.block_bytes, remote_mode=RemoteMode.TCP,
            pool_timeout_s=POOL_TIMEOUT_S,
        )
        namespace = self.base.namespace()
        blocks = self.kv.new_empty((setup.blocks, self.layout.num_layers, self.layout.layer_bytes))
        bs = self.layout.block_tokens
        for i in range(setup.blocks):  # [layers, kv, tokens, heads, hd] -> [layers, layer_bytes]
            blocks[i].copy_(self.kv[:, :, i * bs : (i + 1) * bs].contiguous().view(self.layout.num_layers, -1))
        self.store = OursRemote(self.layout, pool, RemoteMode.TCP, block_keys(self.tokens, namespace), blocks,
                                namespace.tag, setup.workers, read_secret(pool))
        self.stored_s = self.store.store_s()
        self.readers: dict[tuple[FetchPath, int], PoolReader] = {}

    def restore_s(self, path: FetchPath, blocks: int) -> float:
        reader = self.readers.get((path, blocks))
        if reader is None:
            n = blocks * self.layout.block_tokens
            size = blocks * self.layout.block_bytes
            base = dataclasses.replace(self.base, device_bytes=size, remote_bytes=size)
            reader = self.readers[(path, blocks)] = PoolReader(base, path, self.tokens[:n], self.kv[:, :, :n])
        return reader.restore_s()

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.store.close()


def copy_s(nbytes: int) -> float:
    """The calibration's "memcpy (one torch copy)" of ``nbytes``, pages faulted in first."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    step = one_torch_copy(dst, src)
    step()  # fault the pages in
    return step()


def _answer(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main() -> int:
    worker = None
    try:
        setup = WorkerSetup(**json.loads(sys.stdin.readline()))
        worker = Worker(setup)
        _answer({"ready": True, "block_bytes": worker.layout.block_bytes, "stored_s": worker.stored_s})
        for line in sys.stdin:
            command = json.loads(line)
            op = command.get("op")
            if op == "quit":
                break
            if op == "restore":
                seconds = worker.restore_s(FetchPath(command["path"]), int(command["blocks"]))
            elif op == "copy":
                seconds = copy_s(int(command["bytes"]))
            else:
                raise ValueError(f"lab worker: unknown op {op!r}")
            _answer({"seconds": seconds})
    except Exception as error:  # noqa: BLE001 - the lab reads this line and names the host
        _answer({"error": f"{type(error).__name__}: {error}"})
        return 1
    finally:
        if worker is not None:
            worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
