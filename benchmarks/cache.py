"""``python benchmarks/cache.py [ARGS]`` runs ``kvstrata bench cache [ARGS]``.

The benchmark lives in ``kvstrata.bench.cache`` so that the installed ``kvstrata`` command has
it without this checkout on ``sys.path``; this script is a shortcut from the repository root.
It replaces ``benchmarks/host_to_device.py``: the host -> device figure is its "host restore"
row, now measured through ``TieredCache.load`` beside the same plain copy.
"""

from __future__ import annotations

import sys

from kvstrata.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "cache", *sys.argv[1:]]))
