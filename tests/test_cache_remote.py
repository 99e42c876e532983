"""The tiered cache on a shared remote pool, with real processes: sharing, namespaces, faults.

Every pool here is real: the session's pool (``$KVSTRATA_POOL`` or an embedded one), or a
private embedded pool a test starts and kills with SIGKILL, stops with SIGSTOP, or restarts
(at new ports). The other instance of a sharing test
is another Python process running this file as a script (``python test_cache_remote.py
writer|random ARGS``), with its own TieredCache on the same pool; it exits (or runs alongside)
before this process reads. Each test uses a model_id of its own, so no test sees another's
objects in the shared pool.

Block content is a function of the block key (``cache_support.content``): whoever stored a
block, and wherever it is read from, it has one right answer, compared as raw bytes.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from cache_support import assert_loaded_bytes, assert_quiescent, content, kv_for, raw, tokens
from process_support import kill_and_reap, wait_until

from kvstrata.cache import CacheConfig, LoadHandle, LoadResult, StoreResult, TieredCache
from kvstrata.kv.geometry import DType
from kvstrata.kv.layout import KVLayout
from kvstrata.manager.plans import StopReason
from kvstrata.media import FetchPath, Medium, route_text
from kvstrata.policies.prefetch import PrefetchPolicy, PrefetchRule
from kvstrata.policies.write import WritePolicy, WriteRule
from kvstrata.pool import embedded
from kvstrata.pool.config import PoolConfig, RemoteMode, load_pool_config
from kvstrata.tiers.remote import RemoteTier

# 2 layers x K,V x 16 tokens x 2 heads x 32 dims x bf16: 4 KiB a layer, 8 KiB a block.
LAYOUT = KVLayout(num_layers=2, block_tokens=16, kv_heads=2, head_dim=32, dtype=DType.BF16)
B = LAYOUT.block_bytes
D, H, R = Medium.DEVICE, Medium.HOST, Medium.REMOTE
MODES = ["tcp", "shm"]
PATHS = ["direct", "staged"]
ROUTE = {"direct": (R, D), "staged": (R, H, D)}
# The bounds the cache's remote tier is built with by default (CacheConfig's pool_* budgets).
_DEFAULTS = inspect.signature(RemoteTier).parameters
CONNECT_TIMEOUT_S = _DEFAULTS["connect_timeout_s"].default
OP_TIMEOUT_S = _DEFAULTS["op_timeout_s"].default
BACKOFF_S = _DEFAULTS["backoff_s"].default
SLACK_S = 3.0  # scheduling slack on a loaded 2-core CI box, on top of a configured bound
FAST_S = 0.3  # a call to a pool known to be down: no pool call at all (measured: ~1 ms)
# Budgets small enough for tests that wait for a reconnect: probes 0.1 to 0.5 s apart.
QUICK = {"pool_connect_timeout_s": 1.0, "pool_backoff_s": 0.2, "pool_backoff_max_s": 0.5}
CHILD_TIMEOUT_S = 60


def model_id() -> str:
    return f"remote-test-{uuid.uuid4().hex[:12]}"


def make_config(pool: PoolConfig, model: str, mode: str = "tcp", path: str = "auto", device: int = 8,
                host: int = 8, remote: int = 64, **budgets: float) -> CacheConfig:
    # Write-through: every stored block reaches the pool at once. The device tier is a CPU
    # stand-in for HBM, so "direct" means pool -> device memory with no host hop.
    return CacheConfig(
        LAYOUT, model, device_bytes=device * B, host_bytes=host * B,
        write=WriteRule(WritePolicy.WRITE_THROUGH), device="cpu",
        pool=pool, remote_bytes=remote * B, remote_mode=RemoteMode(mode), remote_path=FetchPath(path), **budgets,
    )


def need_daemon(pool: PoolConfig, mode: str) -> None:
    if mode == "shm" and not pool.daemon:
        pytest.skip("the configured pool has no daemon on this host for SHM mode")


@pytest.fixture
def caches():
    """Builds caches; closes those the test left open, checking they were left quiescent."""
    made: list[tuple[TieredCache, bool]] = []

    def make(config: CacheConfig, quiescent: bool = True) -> TieredCache:
        cache = TieredCache(config)
        made.append((cache, quiescent))
        return cache

    yield make
    for cache, quiescent in made:
        if not cache.closed:
            try:
                if quiescent:
                    assert_quiescent(cache)
            finally:
                cache.close()


def store(cache: TieredCache, toks: list[int], tenant: str = "") -> StoreResult:
    return cache.store(toks, kv_for(cache, toks, tenant), tenant=tenant).result(timeout=OP_TIMEOUT_S + SLACK_S)


def load(cache: TieredCache, toks: list[int], tenant: str = "") -> tuple[LoadResult, LoadHandle]:
    """Look up and load ``toks``, check every loaded block's bytes; the caller releases."""
    handle = cache.load(cache.lookup(toks, tenant))
    result = handle.wait(timeout=OP_TIMEOUT_S + SLACK_S)
    assert handle.blocks == result.blocks
    assert_loaded_bytes(cache, handle, cache.keys(toks, tenant))
    return result, handle


def load_released(cache: TieredCache, toks: list[int], tenant: str = "") -> LoadResult:
    result, handle = load(cache, toks, tenant)
    handle.release()
    return result


def timed(fn):
    start = time.monotonic()
    return fn(), time.monotonic() - start




def empty_local_tiers(cache: TieredCache) -> None:
    for medium in (D, H):
        cache.evict(medium, cache.manager.table(medium).capacity_blocks)


def child_env() -> dict:
    return dict(os.environ, GLOG_minloglevel="2")  # Mooncake's INFO logs


def child_command(role: str, pool: PoolConfig, **kwargs) -> list[str]:
    """This file as another instance: ``role`` is ``writer`` or ``random``."""
    return [sys.executable, __file__, role, json.dumps({"pool": pool.to_json(), **kwargs})]


def run_child(role: str, pool: PoolConfig, **kwargs) -> dict:
    """Run another instance to its end; returns the JSON it printed last."""
    done = subprocess.run(child_command(role, pool, **kwargs), capture_output=True, text=True,
                          env=child_env(), timeout=CHILD_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- sharing between instances ----------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
def test_blocks_another_process_stored_are_found_in_the_pool_and_load_bit_exact(pool, caches, mode, path):
    need_daemon(pool, mode)
    model = model_id()
    toks = tokens(1, 5, LAYOUT, tail=7)
    # Instance A, another process: stores 5 blocks (and a tail that is never cached), exits.
    assert run_child("writer", pool, mode=mode, model_id=model, tokens=toks) == {
        "remote_error": None, "blocks": 5, "new_blocks": 5, "in_pool": [True] * 5,
    }

    # Instance B, this process, fresh device and host: nothing local, everything in the pool.
    cache = caches(make_config(pool, model, mode, path))
    assert cache.remote_error is None and cache.manager.table(R).ready_keys() == []
    match = cache.lookup(toks + tokens(2, 2, LAYOUT))
    assert (match.blocks, match.total_blocks, match.media) == (5, 7, (R,) * 5)
    assert match.keys == tuple(cache.keys(toks))

    result, handle = load(cache, toks)
    assert (result.blocks, result.tokens, result.stopped) == (5, 80, None)
    assert result.paths == {ROUTE[path]: 5}
    expected_from = {R: 5 * B} if path == "direct" else {R: 5 * B, H: 5 * B}
    assert (result.bytes_from, result.restored_bytes) == (expected_from, 5 * B)
    handle.release()
    assert cache.lookup(toks).media == (D,) * 5
    # A sequence that shares only the first two blocks of A's prefix matches just those.
    assert cache.lookup(toks[: 2 * LAYOUT.block_tokens] + tokens(3, 3, LAYOUT)).blocks == 2


def _writer(args: dict) -> dict:
    config = make_config(PoolConfig(**args["pool"]), args["model_id"], args["mode"])
    with TieredCache(config) as cache:
        toks = args["tokens"]
        stored = store(cache, toks)
        keys = cache.keys(toks)
        in_pool = cache.tier(R).exists(keys) if cache.remote_error is None else []
        return {"remote_error": cache.remote_error, "blocks": stored.blocks, "new_blocks": stored.new_blocks,
                "in_pool": in_pool}


# --- namespaces -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_another_model_or_tenant_never_matches_blocks_in_the_pool(pool, caches, mode):
    need_daemon(pool, mode)
    model = model_id()
    toks = tokens(4, 3, LAYOUT)
    owner = caches(make_config(pool, model, mode))
    store(owner, toks)
    keys = owner.keys(toks)

    # Positive control: a fresh cache of the same model finds the blocks in the pool.
    assert caches(make_config(pool, model, mode)).lookup(toks).media == (R,) * 3

    other = caches(make_config(pool, model_id(), mode))
    assert other.lookup(toks).blocks == 0
    assert other.tier(R).exists(keys) == [False] * 3  # even asked for the very keys: another name
    assert owner.lookup(toks, tenant="tenant-b").blocks == 0
    fresh = caches(make_config(pool, model, mode))
    assert fresh.lookup(toks, tenant="tenant-b").blocks == 0

    # The other model stores its own KV for the same tokens; the owner's blocks are unchanged.
    store(other, toks)
    store(fresh, toks, tenant="tenant-b")
    empty_local_tiers(owner)
    assert owner.lookup(toks).media == (R,) * 3
    assert load_released(owner, toks).blocks == 3  # bytes checked against the owner's keys


# --- the pool unreachable or dying -------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_no_pool_at_start_the_cache_builds_quickly_and_serves_from_local_tiers(caches, mode):
    address = f"127.0.0.1:{embedded.free_port()}"  # nobody listens
    config = make_config(PoolConfig(master=address, daemon=address), model_id(), mode)
    cache, seconds = timed(lambda: caches(config))
    assert seconds < CONNECT_TIMEOUT_S + SLACK_S
    assert cache.remote_error is not None and address in cache.remote_error
    assert cache.media == [D, H, R] and not cache.tier(R).up  # the pool's tier is there, down, retrying

    toks = tokens(5, 3, LAYOUT, tail=4)
    assert store(cache, toks).new_blocks == 3
    assert load_released(cache, toks).paths == {(D,): 3}
    cache.evict(D, 3)
    assert cache.lookup(toks).media == (H,) * 3  # write-through reached the host tier
    assert load_released(cache, toks).paths == {(H, D): 3}




@pytest.mark.parametrize(("mode", "path"), [("tcp", "direct"), ("shm", "staged"), ("tcp", "staged"), ("shm", "direct")])
def test_pool_killed_mid_run_loads_end_in_bounded_time_and_local_tiers_keep_working(
    private_pool, caches, mode, path
):
    bound_s = OP_TIMEOUT_S + SLACK_S  # one bounded pool call, and scheduling slack
    cache = caches(make_config(private_pool.config, model_id(), mode, path), quiescent=False)
    seqs = {name: tokens(10 + i, 3, LAYOUT) for i, name in enumerate(("before", "daemon", "master"))}
    for toks in seqs.values():
        assert store(cache, toks).new_blocks == 3
    # The pool serves them while it lives (so a miss below is the kill's doing) ...
    empty_local_tiers(cache)
    assert load_released(cache, seqs["before"]).paths == {ROUTE[path]: 3}
    # ... and then they live only in the pool.
    empty_local_tiers(cache)
    for toks in seqs.values():
        assert cache.lookup(toks).media == (R,) * 3

    for victim, fresh in (("daemon", tokens(20, 3, LAYOUT)), ("master", tokens(21, 3, LAYOUT))):
        kill_and_reap(getattr(private_pool, f"{victim}_pid"))
        time.sleep(BACKOFF_S + 0.1)  # past the first probe: it finds the pool dead too
        for toks in (seqs[victim], seqs["before"], tokens(22, 2, LAYOUT)):
            (result, handle), seconds = timed(lambda toks=toks: load(cache, toks))  # bytes checked
            handle.release()
            assert seconds < bound_s, f"{victim} killed: lookup+load took {seconds:.1f} s"
            assert result.blocks == 0 and not result.paths, f"{victim} killed: loaded {result} from a dead pool"
        # Stores keep working on the local tiers, in bounded time.
        stored, seconds = timed(lambda fresh=fresh: store(cache, fresh))
        assert stored.new_blocks == 3 and seconds < bound_s
        assert cache.lookup(fresh).media == (D,) * 3
        assert load_released(cache, fresh).paths == {(D,): 3}
    _, seconds = timed(cache.close)
    assert seconds < bound_s


def test_a_hung_pool_read_never_had_the_device_slots_none_is_quarantined(private_pool, tmp_path):
    """A direct pool -> device read that times out fails as the pool unavailable: the get went
    into the remote tier's own staging, never into device slots, so none is quarantined and
    every slot serves again at once."""
    from kvstrata.tiers.memory import DeviceTier

    timeout_s = 1.0
    config = make_config(private_pool.config, model_id(), "tcp", "direct", device=4, host=0)
    remote = RemoteTier(LAYOUT, config.remote_bytes, private_pool.config, RemoteMode.TCP,
                        namespace_tag=config.namespace().tag, op_timeout_s=timeout_s, backoff_s=0.2, backoff_max_s=0.4)
    cache = TieredCache(config, [DeviceTier(LAYOUT, config.device_bytes, "cpu"), remote])
    try:
        toks = tokens(40, 3, LAYOUT)
        assert store(cache, toks).new_blocks == 3
        cache.evict(D, 4)
        assert cache.lookup(toks).media == (R,) * 3
        os.kill(private_pool.daemon_pid, signal.SIGSTOP)  # it holds the bytes: the read hangs
        try:
            (result, handle), seconds = timed(lambda: load(cache, toks))
            handle.release()
        finally:
            os.kill(private_pool.daemon_pid, signal.SIGCONT)
        assert (result.blocks, result.stopped) == (0, StopReason.UNAVAILABLE) and seconds < timeout_s + SLACK_S
        device = cache.manager.table(D)
        assert (device.quarantined_slots, device.free_blocks) == (0, 4)
        assert wait_until(lambda: remote.up, 5.0)  # a background probe finds it serving again
        assert store(cache, tokens(41, 4, LAYOUT)).new_blocks == 4  # every device slot usable
    finally:
        cache.close()


@pytest.mark.parametrize(("victim", "mode"), [("master", "tcp"), ("daemon", "tcp"), ("daemon", "shm")])
def test_a_hung_pool_costs_one_bounded_wait_then_lookups_loads_and_stores_answer_at_once(
    private_pool, caches, victim, mode
):
    # The cache's default budgets. Before: every lookup of a prefix missing locally waited 10 s
    # on a stopped master, each load 10 s on a stopped daemon, over and over.
    cache = caches(make_config(private_pool.config, model_id(), mode), quiescent=False)
    held = tokens(40, 3, LAYOUT)
    assert store(cache, held).new_blocks == 3
    empty_local_tiers(cache)
    assert cache.lookup(held).media == (R,) * 3
    pid = getattr(private_pool, f"{victim}_pid")
    os.kill(pid, signal.SIGSTOP)
    try:
        waits: list[tuple[str, float]] = []
        for i in range(3):
            for name, call in (("lookup", lambda i=i: cache.lookup(tokens(50 + i, 2, LAYOUT))),
                               ("load", lambda: load_released(cache, held)),
                               ("store", lambda i=i: store(cache, tokens(60 + i, 2, LAYOUT)))):
                result, seconds = timed(call)
                waits.append((f"{name} {i}", round(seconds, 3)))
                assert sum(1 for _, s in waits if s > FAST_S) <= 1, f"{victim} stopped: {waits}"
                assert seconds < OP_TIMEOUT_S + SLACK_S, f"{victim} stopped: {waits}"
            time.sleep(BACKOFF_S + 0.1)  # background probes run meanwhile (and find it hung)
        assert cache.tier(R).up is False and cache.remote_error is not None
        assert load_released(cache, held).blocks == 0  # from the pool, nothing: it is down
    finally:
        os.kill(pid, signal.SIGCONT)
    # It answers again: a probe finds it, the view of it is kept (its objects are all there).
    assert wait_until(lambda: cache.remote_error is None, 2 * BACKOFF_S + 2 * OP_TIMEOUT_S + SLACK_S)
    empty_local_tiers(cache)
    assert wait_until(lambda: cache.lookup(held).media == (R,) * 3, OP_TIMEOUT_S + SLACK_S)
    assert load_released(cache, held).paths == {ROUTE["direct"]: 3}


@pytest.mark.parametrize("mode", MODES)
def test_a_pool_restarted_at_new_ports_is_followed_and_what_the_old_one_held_is_forgotten(
    private_pool, caches, caplog, mode
):
    run_dir = Path(private_pool.run_dir)
    pool = load_pool_config(run_dir / embedded.STATE)  # as a deployment names it: the state file
    model = model_id()
    cache = caches(make_config(pool, model, mode, **QUICK), quiescent=False)
    before, after = tokens(70, 3, LAYOUT), tokens(71, 3, LAYOUT)
    assert store(cache, before).new_blocks == 3
    empty_local_tiers(cache)
    assert cache.lookup(before).media == (R,) * 3

    embedded.stop(run_dir)  # `kvstrata pool stop; kvstrata pool start`: new ports, pool.json rewritten
    for pid in (private_pool.daemon_pid, private_pool.master_pid):
        kill_and_reap(pid)
    restarted = embedded.start(64 * 1024**2, run_dir)
    assert (restarted.config.master, restarted.config.daemon) != (pool.master, pool.daemon)
    try:
        # The first call into the lost pool fails, bounded, and puts the tier down ...
        with caplog.at_level("INFO", logger="kvstrata.pool"):
            result, seconds = timed(lambda: load_released(cache, before))
            assert result.blocks == 0 and seconds < 2 * OP_TIMEOUT_S + SLACK_S
            # ... a background probe reads pool.json again and reconnects to the new pool ...
            assert wait_until(lambda: cache.remote_error is None, QUICK["pool_backoff_max_s"] + 1.0 + SLACK_S)
            assert cache.tier(R).pool == restarted.config
            # ... and the view of the old pool is forgotten: no lookup claims its blocks.
            assert wait_until(lambda: cache.manager.ready_keys(R) == [], SLACK_S)
        assert cache.lookup(before).blocks == 0
        logged = caplog.text
        assert "is down" in logged and restarted.config.master in logged and "forgotten" in logged
        # It serves from the new pool: stores reach it, another instance finds them there.
        assert store(cache, after).new_blocks == 3
        assert caches(make_config(restarted.config, model, mode)).lookup(after).media == (R,) * 3
        empty_local_tiers(cache)
        assert load_released(cache, after).paths == {ROUTE["direct"]: 3}
    finally:
        for pid in (restarted.daemon_pid, restarted.master_pid):
            kill_and_reap(pid)


@pytest.mark.parametrize("down", ["killed", "stopped"])
def test_a_cache_built_while_the_master_is_down_serves_from_the_pool_once_it_is_up(private_pool, caches, down):
    run_dir = Path(private_pool.run_dir)
    pool = load_pool_config(run_dir / embedded.STATE)
    if down == "killed":
        kill_and_reap(private_pool.master_pid)
    else:
        os.kill(private_pool.master_pid, signal.SIGSTOP)
    model = model_id()
    try:
        cache, seconds = timed(lambda: caches(make_config(pool, model, **QUICK)))
        assert seconds < QUICK["pool_connect_timeout_s"] + SLACK_S
        assert pool.master in cache.remote_error and cache.media == [D, H, R] and not cache.tier(R).up
        early = tokens(80, 2, LAYOUT)
        (stored, seconds) = timed(lambda: store(cache, early))
        assert stored.new_blocks == 2 and seconds < FAST_S  # the local tiers serve; the pool is not waited for
        assert timed(lambda: cache.lookup(tokens(81, 2, LAYOUT)))[1] < FAST_S
    finally:
        if down == "stopped":
            os.kill(private_pool.master_pid, signal.SIGCONT)  # back at the same address
        else:  # a new pool in its place, at new ports
            embedded.stop(run_dir)
            kill_and_reap(private_pool.daemon_pid)
            restarted = embedded.start(64 * 1024**2, run_dir)
    try:
        assert wait_until(lambda: cache.remote_error is None, QUICK["pool_backoff_max_s"] + 1.0 + SLACK_S)
        late = tokens(82, 3, LAYOUT)
        assert store(cache, late).new_blocks == 3
        empty_local_tiers(cache)
        assert cache.lookup(late).media == (R,) * 3
        assert load_released(cache, late).paths == {ROUTE["direct"]: 3}
    finally:
        if down == "killed":
            for pid in (restarted.daemon_pid, restarted.master_pid):
                kill_and_reap(pid)


# --- a block gone under a reader ---------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
def test_block_removed_from_the_pool_after_lookup_ends_the_load_before_it(pool, caches, mode, path):
    need_daemon(pool, mode)
    model = model_id()
    writer = caches(make_config(pool, model, mode))
    reader = caches(make_config(pool, model, mode, path))
    for gone in (2, 0):  # a block in the middle of the prefix, then the first
        toks = tokens(30 + gone, 4, LAYOUT)
        store(writer, toks)
        keys = reader.keys(toks)
        match = reader.lookup(toks)
        assert match.media == (R,) * 4
        assert reader.tier(R).remove_from_pool([keys[gone]], force=True) == [True]
        handle = reader.load(match)
        result = handle.wait(timeout=OP_TIMEOUT_S + SLACK_S)
        assert_loaded_bytes(reader, handle, keys)
        handle.release()
        assert (result.blocks, result.stopped, result.stopped_at) == (gone, StopReason.MISSING, R)
        assert result.paths == ({ROUTE[path]: gone} if gone else {})
        # The reader forgot the vanished block: its prefix ends before it, from now on.
        assert reader.lookup(toks).media == (D,) * gone
        assert_quiescent(reader)


# --- randomized: two processes, one pool --------------------------------------------------------


def sequences() -> list[list[int]]:
    """12 sequences of 3 blocks sharing prefixes (18 distinct blocks)."""
    bs = LAYOUT.block_tokens
    return [[(a, b, c)[i // bs] * 1000 + 100 * i for i in range(3 * bs)] for a in range(2)
            for b in range(2, 4) for c in range(4, 7)]


# Small tiers, so blocks keep moving (18 distinct blocks): a pool view of 12, a host of 4, a
# device of 5. The device must outlast what two workers can hold at once (a load's 3 blocks,
# a store's 1): a store that finds every device slot held stores nothing and says only
# new_blocks=0, the same as for blocks already cached, and this test could not tell.
RANDOM_TIERS = {"device": 5, "host": 4, "remote": 12}


def random_run(cache: TieredCache, seed: int, ops: int, threads: int = 2) -> dict:
    """``threads`` workers, ``ops`` random operations each, on ``cache``: store, lookup+load
    (every loaded byte checked against the key's content), evict (any tier, the pool view
    included), prefetch. Returns what happened, mismatches and errors included (as text)."""
    seqs = sequences()
    stored: set[int] = set()
    routes: Counter = Counter()
    mismatches: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def worker(worker_seed: int) -> None:
        rng = random.Random(worker_seed)
        try:
            start.wait()
            for _ in range(ops):
                i = rng.randrange(len(seqs))
                toks = seqs[i]
                op = rng.random()
                if op < 0.3:
                    done = cache.store(toks, kv_for(cache, toks)).result(timeout=OP_TIMEOUT_S + SLACK_S)
                    with lock:
                        stored.add(i)
                        if done.blocks != 3:
                            errors.append(f"store of seq {i}: {done}")
                elif op < 0.8:
                    keys = cache.keys(toks)
                    with cache.load(cache.lookup(toks)) as handle:
                        result = handle.wait(timeout=OP_TIMEOUT_S + SLACK_S)
                        bad = [b for b in range(handle.blocks)
                               if not raw(handle.block(b)).equal(raw(content(LAYOUT, keys[b])))]
                    with lock:
                        routes.update({route_text(r): n for r, n in result.paths.items()})  # JSON keys
                        mismatches.extend(f"seq {i} block {b}" for b in bad)
                elif op < 0.95:
                    cache.evict(rng.choice(cache.media), rng.randint(1, 3))
                else:
                    cache.prefetch(toks, PrefetchRule(PrefetchPolicy.WAIT)).result(timeout=OP_TIMEOUT_S + SLACK_S)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            with lock:
                errors.append(repr(exc))

    workers = [threading.Thread(target=worker, args=(seed * 100 + t,)) for t in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(CHILD_TIMEOUT_S)
    if any(thread.is_alive() for thread in workers):
        errors.append("a worker hung")
    return {"stored": sorted(stored), "routes": dict(routes), "mismatches": mismatches, "errors": errors}


@pytest.mark.parametrize(
    ("mine", "theirs"),
    [(("tcp", "direct"), ("shm", "staged")), (("shm", "staged"), ("tcp", "direct"))],
    ids=["tcp-direct+shm-staged", "shm-staged+tcp-direct"],
)
def test_randomized_two_processes_never_load_other_bytes_than_stored(pool, caches, tmp_path, mine, theirs):
    for mode, _ in (mine, theirs):
        need_daemon(pool, mode)
    model = model_id()
    cache = caches(make_config(pool, model, *mine, **RANDOM_TIERS))
    command = child_command("random", pool, mode=theirs[0], path=theirs[1], model_id=model, seed=2, ops=20)
    with open(tmp_path / "child.log", "wb") as log:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log,
                                 text=True, env=child_env())
    try:
        assert select.select([child.stdout], [], [], CHILD_TIMEOUT_S)[0], "the other instance never got ready"
        assert child.stdout.readline().strip() == "ready", (tmp_path / "child.log").read_text()[-3000:]
        here = random_run(cache, seed=1, ops=20)  # while the other instance runs its own
        out, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, (tmp_path / "child.log").read_text()[-3000:]
    there = json.loads(out.strip().splitlines()[-1])
    for name, run in (("here", here), ("there", there)):
        assert run["errors"] == [] and run["mismatches"] == [], f"{name}: {run}"
    assert sum(here["routes"].values()) > 0 and sum(there["routes"].values()) > 0  # the runs did load

    # Every sequence either instance acknowledged storing loads, bit-exact, from the pool alone:
    # nothing local, and this view of the pool forgotten (found by discovery again).
    assert there["stored"], "the other instance stored nothing"
    empty_local_tiers(cache)
    cache.evict(R, cache.manager.table(R).capacity_blocks)
    seqs = sequences()
    for i in sorted(set(here["stored"]) | set(there["stored"])):
        result = load_released(cache, seqs[i])
        assert result.blocks == 3, f"seq {i}, acknowledged as stored: {result}"
        assert set(result.paths) <= {ROUTE[mine[1]], (D,)}  # a shared prefix may be on the device already


def _random(args: dict) -> dict:
    config = make_config(PoolConfig(**args["pool"]), args["model_id"], args["mode"], args["path"], **RANDOM_TIERS)
    with TieredCache(config) as cache:
        assert cache.remote_error is None, cache.remote_error
        print("ready", flush=True)
        return random_run(cache, args["seed"], args["ops"])


if __name__ == "__main__":
    _role, _args = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps({"writer": _writer, "random": _random}[_role](_args)), flush=True)
    # The caches are closed; skip interpreter teardown, where Mooncake's own teardown of an
    # SHM client aborted ("terminate called without an active exception") in about 1 of 10
    # runs of a multi-threaded instance: process exit hygiene is not what these tests check.
    sys.stderr.flush()
    os._exit(0)
