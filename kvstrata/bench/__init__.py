"""Benchmarks run by ``kvstrata bench``: each measures kvstrata beside baselines measured in
the same run, on the same bytes, so the ratios hold on whatever machine runs them.

A leaf: nothing outside this package imports it; ``kvstrata.cli`` names ``kvstrata.bench.cli``
(this package's ``kvstrata bench`` command) to register it, and nothing else. What the product
needs from measuring lives in the product: ``kvstrata.timing``, ``kvstrata.rounds``,
``kvstrata.progress``, ``kvstrata.pool.raw``, ``kvstrata.workload`` and ``kvstrata.calibrate``
(the lab's restores, and the serving calibration in ``kvstrata.calibrate.serving``: ``bench
serve`` runs its servers, workload and client); reports are frozen dataclasses serialized by
``kvstrata.report``.

Bandwidths are decimal GB/s (1 GB = 1e9 bytes), as everywhere in kvstrata.
"""
