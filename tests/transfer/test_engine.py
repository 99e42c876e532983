"""The transfer engine: handlers by medium pair, results and failures through futures, threads."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from kvstrata.errors import CorruptBlock
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.media import Medium
from kvstrata.tiers.base import Tier
from kvstrata.tiers.memory import DeviceTier, HostTier
from kvstrata.tiers.table import BlockState
from kvstrata.transfer import HANDLERS, TransferEngine, TransferResult

LAYOUT = KVLayout(num_layers=4, block_tokens=16, kv_heads=2, head_dim=8, dtype=DType.FP16)  # 4 KiB blocks
BLOCK = LAYOUT.block_bytes


class DictTier(Tier):
    """A tier without addressable memory, as the remote store will be (not written yet):
    whole blocks in and out by copy, verified by key."""

    medium = Medium.REMOTE

    def __init__(self, layout: KVLayout, capacity_bytes: int) -> None:
        super().__init__(layout, capacity_bytes)
        self._blocks: dict[int, tuple[bytes, torch.Tensor]] = {}

    def write(self, slot, key, src):
        assert src.shape == (self.layout.num_layers, self.layout.layer_bytes)
        self._blocks[slot] = (key, src.to("cpu", copy=True))

    def read_into(self, slot, key, dst, layers=slice(None)):
        stored_key, data = self._blocks[slot]
        if stored_key != key:
            raise CorruptBlock(f"slot {slot} holds another block")
        assert dst.shape == data[layers].shape
        dst.copy_(data[layers])

    def close(self):
        self._blocks.clear()


class CorruptHostTier(HostTier):
    """A host tier whose every read fails verification (as a disk tier's bad checksum would)."""

    def read_into(self, slot, key, dst, layers=slice(None)):
        dst.fill_(0xEE)  # garbage may land before the check fails; the caller must not use it
        raise CorruptBlock(f"block {key.hex()[:12]} failed its checksum")


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def random_block(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (LAYOUT.num_layers, LAYOUT.layer_bytes), dtype=torch.uint8, generator=generator)


def store(tier: Tier, k: bytes, block: torch.Tensor) -> int:
    reservation = tier.table.prepare_store(k)
    tier.write(reservation.slot, k, block)
    tier.table.complete_store(k, ok=True)
    return reservation.slot


def contents(tier: Tier, slot: int, k: bytes) -> torch.Tensor:
    out = torch.empty((LAYOUT.num_layers, LAYOUT.layer_bytes), dtype=torch.uint8)
    tier.read_into(slot, k, out)
    return out


KINDS = ["device", "host", "disk", "remote"]


@pytest.fixture
def make_tier(tmp_path):
    made = []

    def make(kind: str, blocks: int = 64) -> Tier:
        capacity = blocks * BLOCK
        if kind == "device":
            tier = DeviceTier(LAYOUT, capacity)
        elif kind == "host":
            tier = HostTier(LAYOUT, capacity)
        elif kind == "remote":
            tier = DictTier(LAYOUT, capacity)
        else:
            try:
                from kvstrata.tiers.disk import DiskTier
            except ModuleNotFoundError as error:
                if error.name != "kvstrata.tiers.disk":
                    raise  # disk.py exists but is broken: fail, don't hide it
                pytest.skip("kvstrata.tiers.disk is not written yet")
            directory = tmp_path / f"disk{len(made)}"
            directory.mkdir()
            tier = DiskTier(LAYOUT, capacity, directory=directory)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def engine():
    with TransferEngine(workers=2) as engine:
        yield engine


# --- dispatch -------------------------------------------------------------------------------


def test_every_medium_pair_has_a_handler():
    assert set(HANDLERS) == {(s, d) for s in Medium for d in Medium}


@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
def test_each_pair_moves_the_block_bit_exact(make_tier, engine, src_kind, dst_kind):
    src, dst = make_tier(src_kind), make_tier(dst_kind)
    store(src, key(0), random_block(0))  # the moved block sits in slot 1, not 0
    block = random_block(1)
    src_slot = store(src, key(1), block)
    dst.table.prepare_store(key(8))  # and lands in slot 1 too
    reservation = dst.table.prepare_store(key(1))

    result = engine.submit(src, src_slot, dst, reservation.slot, key(1)).result(timeout=10)

    assert (src_slot, reservation.slot) == (1, 1)
    assert result.bytes == BLOCK
    assert (result.src, result.dst) == (src.medium, dst.medium)
    assert torch.equal(contents(dst, reservation.slot, key(1)), block)


@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", ["device", "host"])
def test_layer_slice_moves_only_those_layers(make_tier, engine, src_kind, dst_kind):
    src, dst = make_tier(src_kind), make_tier(dst_kind)
    block = random_block(2)
    src_slot = store(src, key(1), block)
    dst_slot = dst.table.prepare_store(key(1)).slot

    result = engine.run(src, src_slot, dst, dst_slot, key(1), layers=slice(1, 3))

    assert result.bytes == 2 * LAYOUT.layer_bytes
    view = dst.view(dst_slot).cpu()
    assert torch.equal(view[1:3], block[1:3])
    assert not view[[0, 3]].any()  # untouched layers still hold the pool's zeros


@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", ["disk", "remote"])
def test_layer_slice_into_a_tier_without_view_is_refused(make_tier, engine, src_kind, dst_kind):
    src, dst = make_tier(src_kind), make_tier(dst_kind)
    src_slot = store(src, key(1), random_block(3))
    future = engine.submit(src, src_slot, dst, dst.table.prepare_store(key(1)).slot, key(1), layers=slice(0, 2))
    with pytest.raises(ValueError, match="whole blocks"):
        future.result(timeout=10)


def test_a_registered_handler_serves_its_pair_only(make_tier):
    calls = []

    def spy(src, src_slot, dst, dst_slot, k, layers):
        calls.append((src.medium, dst.medium, src_slot, dst_slot, k, layers))
        return 123

    host, device = make_tier("host"), make_tier("device")
    block = random_block(4)
    store(host, key(1), block)
    store(device, key(2), block)
    with TransferEngine(workers=1, handlers={(Medium.HOST, Medium.DEVICE): spy}) as engine:
        assert engine.run(host, 0, device, 5, key(1), slice(2, 4)).bytes == 123
        assert engine.run(device, 0, host, 7, key(2)).bytes == BLOCK  # the default handler
    assert calls == [(Medium.HOST, Medium.DEVICE, 0, 5, key(1), slice(2, 4))]
    assert torch.equal(host.view(7), block)


def test_bad_requests_raise_at_submit(make_tier, engine):
    host, device = make_tier("host"), make_tier("device")
    other = HostTier(KVLayout(4, 32, 2, 8, DType.FP16), 4 * BLOCK)
    try:
        with pytest.raises(ValueError, match="different layouts"):
            engine.submit(host, 0, other, 0, key(1))
    finally:
        other.close()
    with pytest.raises(ValueError, match="contiguous"):
        engine.submit(host, 0, device, 0, key(1), layers=slice(0, 4, 2))
    with pytest.raises(ValueError, match="workers"):
        TransferEngine(workers=0)


# --- results and failures -------------------------------------------------------------------


def test_future_completes_with_a_result(make_tier, engine):
    host, device = make_tier("host"), make_tier("device")
    slot = store(host, key(1), random_block(5))
    future = engine.submit(host, slot, device, 3, key(1))
    assert isinstance(future, Future)
    result = future.result(timeout=10)
    assert isinstance(result, TransferResult)
    assert (result.src, result.dst, result.bytes) == (Medium.HOST, Medium.DEVICE, BLOCK)
    assert result.seconds > 0
    assert result.gbps == pytest.approx(BLOCK / result.seconds / 1e9)
    with pytest.raises(AttributeError):
        result.bytes = 0  # frozen


def test_run_moves_bytes_on_the_calling_thread(make_tier):
    threads = []

    def record(src, src_slot, dst, dst_slot, k, layers):
        threads.append(threading.current_thread())
        return 0

    host = make_tier("host")
    with TransferEngine(handlers={(Medium.HOST, Medium.HOST): record}) as engine:
        engine.run(host, 0, host, 1, key(1))
        engine.submit(host, 0, host, 1, key(1)).result(timeout=10)
    assert threads[0] is threading.current_thread()
    assert threads[1] is not threading.current_thread()


def test_handler_failure_surfaces_and_leaves_the_slot_to_the_caller(make_tier, engine):
    source = CorruptHostTier(LAYOUT, 4 * BLOCK)
    device = make_tier("device")
    try:
        store(source, key(1), random_block(6))
        reservation = device.table.prepare_store(key(1))
        future = engine.submit(source, 0, device, reservation.slot, key(1))
        assert isinstance(future.exception(timeout=10), CorruptBlock)
        # The engine never touches the tables: the slot stays reserved until the caller acts.
        assert device.table.state(key(1)) is BlockState.WRITING
        assert device.table.free_blocks == device.table.capacity_blocks - 1
        device.table.complete_store(key(1), ok=False)
        assert device.table.state(key(1)) is None
        assert device.table.free_blocks == device.table.capacity_blocks
    finally:
        source.close()


def test_close_drains_then_refuses(make_tier):
    host, device = make_tier("host"), make_tier("device")
    block = random_block(7)
    store(host, key(1), block)
    engine = TransferEngine(workers=1)
    futures = [engine.submit(host, 0, device, slot, key(1)) for slot in range(8)]
    engine.close()
    engine.close()
    assert all(f.done() and f.exception() is None for f in futures)
    assert all(torch.equal(device.view(slot).cpu(), block) for slot in range(8))
    with pytest.raises(RuntimeError):
        engine.submit(host, 0, device, 0, key(1))


# --- threads --------------------------------------------------------------------------------


def test_fifty_transfers_from_four_threads_are_bit_exact(make_tier, engine):
    host, device = make_tier("host"), make_tier("device")
    blocks = [random_block(100 + i) for i in range(50)]
    for i, block in enumerate(blocks):
        store(host, key(i), block)
    futures: dict[int, Future] = {}
    lock = threading.Lock()

    def submitter(first: int) -> None:
        for i in range(first, 50, 4):
            # a host slot's index is its block's index (stored in order into a fresh tier)
            future = engine.submit(host, i, device, 49 - i, key(i))
            with lock:
                futures[i] = future

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(futures) == list(range(50))
    assert sum(f.result(timeout=10).bytes for f in futures.values()) == 50 * BLOCK
    for i, block in enumerate(blocks):
        assert torch.equal(device.view(49 - i).cpu(), block), f"block {i}"


def test_at_most_workers_handlers_run_at_once(make_tier):
    lock = threading.Lock()
    running, peak = 0, 0
    release = threading.Event()

    def blocking(src, src_slot, dst, dst_slot, k, layers):
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        release.wait(timeout=10)
        with lock:
            running -= 1
        return 1

    host = make_tier("host")
    with TransferEngine(workers=2, handlers={(Medium.HOST, Medium.HOST): blocking}) as engine:
        futures = [engine.submit(host, 0, host, 1, key(i)) for i in range(6)]
        deadline = time.monotonic() + 5
        while running < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)  # room for a third handler to start, were the pool not bounded
        with lock:
            assert (running, peak) == (2, 2)
        release.set()
        assert sum(f.result(timeout=10).bytes for f in futures) == 6
    assert peak == 2
