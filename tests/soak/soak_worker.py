"""One soak process: stores and loads through device, host, disk and the pool until told to stop.

Run by tests/soak/test_soak.py as ``python soak_worker.py ARGS_JSON``. It stores sequences
(some extending an earlier one, so lookups hit partial prefixes), loads its own and the
other process's (through the pool), checks every loaded block's bytes against the content its
key names, and times every call. When the fault phase is over (the test creates a file) it
waits for the pool, reads back every acknowledged sequence still indexed, checks that no
device slot is pinned, stuck or retired, and writes its counts as JSON.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cache_support

from cache_support import content, kv_for, same_bytes  # noqa: E402

from kvstrata.cache import CacheConfig, TieredCache  # noqa: E402
from kvstrata.kv.geometry import DType  # noqa: E402
from kvstrata.kv.layout import KVLayout  # noqa: E402
from kvstrata.manager.table import BlockState  # noqa: E402
from kvstrata.media import Medium  # noqa: E402
from kvstrata.policies.write import WritePolicy, WriteRule  # noqa: E402
from kvstrata.pool.config import RemoteMode, load_pool_config  # noqa: E402

# 2 layers x K,V x 16 tokens x 2 heads x 32 dims x bf16: 8 KiB a block.
LAYOUT = KVLayout(num_layers=2, block_tokens=16, kv_heads=2, head_dim=32, dtype=DType.BF16)
B = LAYOUT.block_bytes
MAX_BLOCKS = 5  # a sequence's full blocks at most (the device tier holds 16: a load always fits)
POOL_TIMEOUT_S = 1.0
BUDGETS = {
    "pool_timeout_s": POOL_TIMEOUT_S,
    "pool_connect_timeout_s": 1.0,
    "pool_backoff_s": 0.2,
    "pool_backoff_max_s": 1.0,
}
# A call's budget: a lookup and a load (or a store's write-through) each wait on the pool at
# most POOL_TIMEOUT_S; the rest is local work and scheduling slack on a loaded 2-core box.
CALL_BUDGET_S = 2 * POOL_TIMEOUT_S + 3.0
SEQ_BASE = 1_000_000  # worker i's sequences: i * SEQ_BASE + n


def seq_tokens(worker: int, n: int, rng: random.Random, stored: dict[int, list[int]]) -> list[int]:
    """Sequence n of ``worker``: a fresh run of blocks, or an earlier sequence's prefix plus one."""
    start = (worker * SEQ_BASE + n) * 1000
    if stored and rng.random() < 0.3:
        base = stored[rng.choice(list(stored))]
        keep = rng.randint(1, max(1, min(len(base) // LAYOUT.block_tokens, MAX_BLOCKS - 1)))
        return base[: keep * LAYOUT.block_tokens] + list(range(start, start + LAYOUT.block_tokens))
    return list(range(start, start + rng.randint(1, MAX_BLOCKS) * LAYOUT.block_tokens))


class Soak:
    def __init__(self, args: dict) -> None:
        self.args = args
        self.rng = random.Random(args["seed"])
        pool = load_pool_config(Path(args["state"]))  # re-read on reconnect: a restarted pool is followed
        self.cache = TieredCache(
            CacheConfig(
                LAYOUT,
                args["model"],
                device_bytes=16 * B,
                host_bytes=48 * B,
                disk_dir=Path(args["disk_dir"]),
                disk_bytes=args["disk_blocks"] * B,
                write=WriteRule(WritePolicy.WRITE_THROUGH),
                device="cpu",
                pool=pool,
                remote_bytes=2048 * B,
                remote_mode=RemoteMode(args["mode"]),
                **BUDGETS,
            )
        )
        self.stored: dict[int, list[int]] = {}  # acknowledged sequences by n
        self.counts: Counter = Counter()
        self.stops: Counter = Counter()
        self.slowest: list[tuple[float, str]] = []  # (seconds, what) over the budget
        self.longest_s = 0.0

    def timed(self, what: str, call):
        start = time.monotonic()
        out = call()
        seconds = time.monotonic() - start
        self.longest_s = max(self.longest_s, seconds)
        if seconds > CALL_BUDGET_S:
            self.slowest.append((round(seconds, 3), what))
        return out

    def store(self, n: int) -> None:
        toks = seq_tokens(self.args["worker"], n, self.rng, self.stored)
        kv = kv_for(self.cache, toks)
        result = self.timed("store", lambda: self.cache.store(toks, kv).result(timeout=CALL_BUDGET_S + 5))
        self.counts["stores"] += 1
        self.counts["blocks stored"] += result.new_blocks
        self.counts["blocks refused"] += result.refused_blocks
        if result.refused_blocks == 0:
            self.stored[n] = toks  # acknowledged: every block on the device, written through below

    def load(self, toks: list[int], phase: str) -> tuple[int, int]:
        """(blocks indexed at lookup, blocks loaded byte-exact); wrong bytes are counted."""

        def run():
            match = self.cache.lookup(toks)
            handle = self.cache.load(match)
            return match, handle, handle.wait(timeout=CALL_BUDGET_S + 5)

        match, handle, result = self.timed(f"{phase} load", run)
        try:
            keys = self.cache.keys(toks)
            for i in range(handle.blocks):
                if not same_bytes(handle.block(i), content(LAYOUT, keys[i])):
                    self.counts["wrong blocks"] += 1
            for medium, size in result.bytes_from.items():
                self.counts[f"{phase} bytes from {medium.label}"] += size
        finally:
            handle.release()
        self.counts[f"{phase} loads"] += 1
        self.counts[f"{phase} blocks loaded"] += result.blocks
        if result.stopped is not None:  # and the tier of the first block not loaded
            at = match.media[result.blocks].label if result.blocks < match.blocks else "-"
            self.stops[f"{phase} {result.stopped.value} {at}"] += 1
        return match.blocks, result.blocks

    def run(self) -> None:
        stop_file, n = Path(self.args["stop_file"]), 0
        other = 1 - self.args["worker"]
        while not stop_file.exists():
            roll = self.rng.random()
            if roll < 0.45 or not self.stored:
                self.store(n)
                n += 1
            elif roll < 0.85:
                self.load(self.stored[self.rng.choice(list(self.stored))], "soak")
            else:  # the other process's sequence: found (if at all) through the pool
                theirs = self.rng.randrange(max(1, n))
                self.load(
                    list(
                        range(
                            (other * SEQ_BASE + theirs) * 1000, (other * SEQ_BASE + theirs) * 1000 + LAYOUT.block_tokens
                        )
                    ),
                    "soak",
                )

    def read_back(self) -> None:
        """Every acknowledged sequence: what is still indexed loads, and loads byte-exact."""
        deadline = time.monotonic() + 30
        while self.cache.remote_error is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        self.counts["pool up at read-back"] = int(self.cache.remote_error is None)
        for toks in self.stored.values():
            indexed, loaded = self.load(toks, "final")
            self.counts["final blocks indexed"] += indexed
            self.counts["final blocks short"] += indexed - loaded

    def leaks(self) -> dict:
        table = self.cache.manager.table(Medium.DEVICE)
        return {
            "pinned": sum(len(self.cache.manager.table(m).pinned()) for m in self.cache.media),
            "device used+free": table.used_blocks + table.free_blocks,
            "device capacity": table.capacity_blocks,
            "device retired": table.quarantined_slots,
            "device in flight": sum(1 for key in table.owners().values() if table.state(key) is not BlockState.READY),
        }


def main() -> None:
    args = json.loads(sys.argv[1])
    soak = Soak(args)
    try:
        soak.run()
        soak.read_back()
        out = {
            "counts": dict(soak.counts),
            "stops": dict(soak.stops),
            "over_budget": soak.slowest,
            "longest_s": round(soak.longest_s, 3),
            "acknowledged": len(soak.stored),
            "leaks": soak.leaks(),
        }
    finally:
        start = time.monotonic()
        soak.cache.close()
        close_s = time.monotonic() - start
    out["close_s"] = round(close_s, 3)
    Path(args["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
