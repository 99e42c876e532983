"""Sizes at the command line: decimal units unless a binary one is named, printed decimal."""

from __future__ import annotations

import argparse

import pytest

from kvstrata.cli.units import format_size, parse_size, size_arg


@pytest.mark.parametrize(
    ("text", "size_bytes"),
    [
        ("2GB", 2_000_000_000),
        ("2 gb", 2_000_000_000),
        ("1.5g", 1_500_000_000),
        ("512MB", 512_000_000),
        ("10kB", 10_000),
        ("1TB", 10**12),
        ("4096", 4096),
        ("7B", 7),
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("3KiB", 3 * 2**10),
        ("1ti", 2**40),
    ],
)
def test_gb_is_decimal_and_binary_units_only_when_named(text, size_bytes):
    assert parse_size(text) == size_bytes


@pytest.mark.parametrize("text", ["", "GB", "0", "0GB", "-1GB", "2XB", "2 GBs", "2ib", "two GB"])
def test_what_is_not_a_size_is_refused_with_the_forms_accepted(text):
    with pytest.raises(ValueError, match=r"not a size.*2GB = 2e9 bytes.*GiB"):
        parse_size(text)
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        size_arg(text)


@pytest.mark.parametrize(
    ("size_bytes", "text"),
    [
        (2_000_000_000, "2 GB"),
        (2 * 2**30, "2.147 GB"),
        (512 * 2**20, "536.9 MB"),
        (64_000_000, "64 MB"),
        (1_500, "1.5 kB"),
        (512, "512 B"),
        (12_345 * 10**12, "12345 TB"),
    ],
)
def test_sizes_print_in_decimal_units(size_bytes, text):
    assert format_size(size_bytes) == text


def test_a_printed_size_reads_back_within_its_rounding():
    for size_bytes in (1, 999, 10**6, 123_456_789, 2 * 2**30, 7 * 10**12):
        assert parse_size(format_size(size_bytes).replace(" ", "")) == pytest.approx(size_bytes, rel=5e-4)
