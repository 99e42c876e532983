"""Fixtures shared by the planner tests: the geometry and profiles they plan on."""

import pytest

from kvstrata.hardware.profile import load_profile
from kvstrata.kv import load_geometry


@pytest.fixture(scope="session")
def llama70b():
    return load_geometry("llama-3-70b")


@pytest.fixture(scope="session")
def h200():
    return load_profile("h200-cx7-gen5")


@pytest.fixture(scope="session")
def b200():
    return load_profile("b200-cx8-gen6")


@pytest.fixture(scope="session")
def ws():
    return load_profile("workstation")
