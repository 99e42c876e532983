"""A restore from the shared pool: RemoteTier reads vs raw Mooncake ``batch_get_into``.

Writes ``--total-mib`` as blocks of ``--block-mib`` through a RemoteTier (objects = 64-byte
header + payload), then reads the same objects back, ``--repeat`` times each way, and prints
the median in decimal GB/s (1 GB = 1e9 bytes) of payload bytes:

- raw batch: one ``batch_get_into`` call for every object (header + payload, one buffer each).
- raw per block: one ``batch_get_into`` call per object, one after another.
- tier direct: ``RemoteTier.read_into`` per block into memory from ``tier.allocate`` (zero-copy:
  header and payload scatter straight into place, then the header is verified).
- tier staged: ``read_into`` into an ordinary tensor (through the thread's staging buffer, plus
  one copy; in SHM mode, unregistered memory is always staged).
- tier direct 2T: two threads, each reading half the blocks (the cache's transfer engine runs
  two workers by default).

The pool is an embedded one (master + daemon on loopback, started here) unless ``--pool`` names
a pool config (TOML or pool.json).

Usage: python benchmarks/remote_restore.py [--total-mib 256] [--block-mib 32] [--repeat 5]

Measured (basis: this script with the defaults, median of 5 per run, lowest-highest of 3 runs)
on the development VM: 2 vCPU AMD EPYC, 24 GB RAM, Mooncake 0.3.13.post1 (non-CUDA wheel),
pool on loopback. Decimal GB/s.

    mode  raw batch    raw per block  tier direct  tier staged  tier direct 2T
    tcp    2.17-2.20    2.16-2.35      2.15-2.30    1.36-1.55    1.66-2.57
    shm   15.7-17.3    12.7-14.8      11.8-14.4     4.9-9.3     15.0-15.8

Reading: a read through the tier into registered memory runs level with the raw call it makes
(one object per call), header verification included; the raw batch gains a little by putting all
objects in one call, and two reading threads recover it. Staging costs a copy (and in SHM mode
a second pass over memory): build the host tier on ``tier.allocate``. TCP on loopback is bound
by the transport (a copy through sockets); SHM is a memcpy by the daemon into shared memory.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.pool import embedded
from kvstrata.pool.client import PoolClient
from kvstrata.pool.config import load_pool_config
from kvstrata.tiers import poolvalue
from kvstrata.tiers.remote import RemoteMode, RemoteTier, fresh_tag


def layout_for(block_mib: int) -> KVLayout:
    # 8 layers x K,V x tokens x 8 heads x 128 dims x bf16 = 32 KiB a token: block_mib * 32 tokens.
    return KVLayout(num_layers=8, block_tokens=block_mib * 32, kv_heads=8, head_dim=128, dtype=DType.BF16)


def median_gbps(fn, payload_bytes: int, repeat: int) -> float:
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return payload_bytes / statistics.median(seconds) / 1e9


def run_mode(pool, mode: RemoteMode, total_bytes: int, layout: KVLayout, repeat: int) -> dict[str, float]:
    count = total_bytes // layout.block_bytes
    tier = RemoteTier(layout, total_bytes, pool, mode, namespace_tag=fresh_tag(), op_timeout_s=60.0)
    try:
        shape = (count, layout.num_layers, layout.layer_bytes)
        src = tier.allocate(total_bytes).view(shape)
        src.random_(0, 256)
        keys = [i.to_bytes(16, "little") for i in range(count)]
        for i, key in enumerate(keys):
            slot = tier.table.prepare_store(key).slot
            tier.write(slot, key, src[i])
            tier.table.complete_store(key, ok=True)
        dst = tier.allocate(total_bytes).view(shape)
        plain = torch.zeros(shape, dtype=torch.uint8)
        value_bytes = poolvalue.HEADER_BYTES + layout.block_bytes
        client = PoolClient(pool, mode, op_timeout_s=60.0)  # the raw store API, its own connection
        raw_dst = client.allocate(count * value_bytes)  # registered, header + payload per object
        names = [tier.object_name(k) for k in keys]
        ptrs = [raw_dst.data_ptr() + i * value_bytes for i in range(count)]

        def raw_batch() -> None:
            assert client.call("raw", "batch_get_into", names, ptrs, [value_bytes] * count) == [value_bytes] * count

        def raw_each() -> None:
            for name, ptr in zip(names, ptrs):
                assert client.call("raw", "batch_get_into", [name], [ptr], [value_bytes]) == [value_bytes]

        def tier_into(target: torch.Tensor, indices: range) -> None:
            for i in indices:
                tier.read_into(tier.table.slot(keys[i]), keys[i], target[i])

        def tier_2t() -> None:
            half = count // 2
            other = threading.Thread(target=tier_into, args=(dst, range(half, count)))
            other.start()
            tier_into(dst, range(half))
            other.join()

        results = {
            "raw batch": median_gbps(raw_batch, total_bytes, repeat),
            "raw per block": median_gbps(raw_each, total_bytes, repeat),
            "tier direct": median_gbps(lambda: tier_into(dst, range(count)), total_bytes, repeat),
            "tier staged": median_gbps(lambda: tier_into(plain, range(count)), total_bytes, repeat),
            "tier direct 2T": median_gbps(tier_2t, total_bytes, repeat),
        }
        assert torch.equal(dst, src) and torch.equal(plain, src), "restored bytes differ"
        tier.remove_from_pool(keys, force=True)
        client.close()
        return results
    finally:
        tier.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--block-mib", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--pool", help="a pool config (TOML or pool.json); default: an embedded pool")
    args = parser.parse_args()
    layout = layout_for(args.block_mib)
    total = args.total_mib << 20
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        pool = load_pool_config(args.pool) if args.pool else embedded.start(2 * total + (256 << 20), run_dir).config
        try:
            rows = {mode.value: run_mode(pool, mode, total, layout, args.repeat) for mode in RemoteMode}
        finally:
            if not args.pool:
                embedded.stop(run_dir)
    columns = list(next(iter(rows.values())))
    print(f"{args.total_mib} MiB restore in {args.block_mib} MiB blocks, median of {args.repeat}, decimal GB/s")
    print("mode  " + "  ".join(f"{c:>14}" for c in columns))
    for mode, row in rows.items():
        print(f"{mode:<4}  " + "  ".join(f"{row[c]:>14.2f}" for c in columns))


if __name__ == "__main__":
    main()
