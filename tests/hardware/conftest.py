"""Shared fixtures for the hardware-model tests: built-in profiles, loaded once per session.

Profiles are frozen and their topology is a cached, read-only graph, so sharing them between
tests is safe.
"""

from __future__ import annotations

import pytest

from kvstrata.hardware.profile import HardwareProfile, load_profile

from . import BUILTINS


@pytest.fixture(scope="session")
def profiles() -> dict[str, HardwareProfile]:
    return {name: load_profile(name) for name in BUILTINS}


@pytest.fixture(scope="session")
def h200(profiles) -> HardwareProfile:
    return profiles["h200-cx7-gen5"]


@pytest.fixture(scope="session")
def b200(profiles) -> HardwareProfile:
    return profiles["b200-cx8-gen6"]


@pytest.fixture(scope="session")
def socket_direct(profiles) -> HardwareProfile:
    return profiles["gen5-cx8-socket-direct"]


@pytest.fixture(scope="session")
def workstation(profiles) -> HardwareProfile:
    return profiles["workstation"]
