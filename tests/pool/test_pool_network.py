"""The pool's own network (kvstrata.pool.network): names, and threads that enter a namespace
and come back, on real namespaces (root only; the rest skips, saying why)."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from kvstrata.pool import network as netns
from kvstrata.pool.config import PoolConfig


def here() -> int:
    """The inode of the calling thread's network namespace."""
    return os.stat("/proc/thread-self/ns/net").st_ino


@pytest.fixture
def namespace():
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    name = f"kvstrata-test-{os.getpid()}-{threading.get_ident() % 10000}"
    netns.create(name)
    yield name
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".", "x" * 65, "a b", 7, None])
def test_a_name_that_cannot_name_a_namespace_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match="pool network must name a network namespace") as caught:
        netns.check_name(bad)
    assert "\n" not in str(caught.value)


def test_a_pool_config_names_its_network_and_refuses_a_path():
    assert PoolConfig(master="127.0.0.1:1", network="kvstrata-0").to_json()["network"] == "kvstrata-0"
    with pytest.raises(ValueError, match="pool network"):
        PoolConfig(master="127.0.0.1:1", network="../etc")


def test_the_users_pools_share_one_network_named_for_the_user():
    assert netns.name_for_user() == f"kvstrata-{os.geteuid()}"


def test_a_thread_enters_a_namespace_and_comes_back_and_no_other_thread_moves(namespace):
    target = os.stat(netns.NAMESPACES / namespace).st_ino
    mine = here()
    seen = {}

    def body():
        seen["before"] = here()
        netns.enter(namespace)
        seen["in"] = here()
        netns.enter(namespace)  # already there: no move
        seen["again"] = here()
        netns.enter(None)
        seen["back"] = here()

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == {"before": mine, "in": target, "again": target, "back": mine}
    assert here() == mine


def test_run_in_and_a_runner_run_inside_and_leave_the_caller_where_it_is(namespace):
    target = os.stat(netns.NAMESPACES / namespace).st_ino
    mine = here()
    assert netns.run_in(namespace, here) == target
    assert netns.run_in(None, here) == mine
    runner = netns.Runner(namespace)
    try:
        assert runner.run(here) == target == runner.run(here)
    finally:
        runner.close()
    assert here() == mine


def test_a_namespace_made_anew_under_the_same_name_is_entered_again(namespace):
    # A thread in the old one checks which it is in on each entry (by inode), and moves.
    runner = netns.Runner(namespace)
    try:
        first = runner.run(here)
        subprocess.run(["ip", "netns", "del", namespace], check=True, capture_output=True)
        with pytest.raises(netns.NetworkError, match=f"pool network {namespace} does not exist"):
            runner.run(netns.enter, namespace)
        netns.create(namespace)
        now = runner.run(here)
        assert now == os.stat(netns.NAMESPACES / namespace).st_ino != first
    finally:
        runner.close()


def test_create_keeps_a_namespace_that_is_there(namespace):
    before = os.stat(netns.NAMESPACES / namespace).st_ino
    netns.create(namespace)
    assert os.stat(netns.NAMESPACES / namespace).st_ino == before


def test_entering_a_namespace_that_is_gone_says_so_in_one_line():
    with pytest.raises(netns.NetworkError, match="does not exist") as caught:
        netns.run_in("kvstrata-no-such-network", here)
    assert "\n" not in str(caught.value)
