"""Benchmarks run by ``kvstrata bench``: each measures kvstrata beside baselines measured in
the same run, on the same bytes, so the ratios hold on whatever machine runs them.

Bandwidths are decimal GB/s (1 GB = 1e9 bytes), as everywhere in kvstrata.
"""
