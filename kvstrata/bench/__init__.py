"""Benchmarks run by ``kvstrata bench``: each measures kvstrata beside baselines measured in
the same run, on the same bytes, so the ratios hold on whatever machine runs them.

A leaf: nothing outside this package and ``kvstrata.cli.bench`` imports it. What the product
needs from measuring lives in ``kvstrata.timing``, ``kvstrata.progress``, ``kvstrata.pool.raw``
and ``kvstrata.workload``; reports are frozen dataclasses serialized by ``kvstrata.report``.

Bandwidths are decimal GB/s (1 GB = 1e9 bytes), as everywhere in kvstrata.
"""
