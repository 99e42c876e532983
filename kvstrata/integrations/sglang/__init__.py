"""kvstrata as SGLang's HiCache L3 storage (``--hicache-storage-backend dynamic``).

Launch SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstrata",
        "module_path": "kvstrata.integrations.sglang", "class_name": "KVStrataHiCacheStorage",
        "interface_v1": 1, "kvstrata_disk_dir": "/nvme/kvstrata", "kvstrata_disk_bytes": 200e9,
        "kvstrata_pool": "env"}'

``interface_v1`` makes SGLang's controller use the zero-copy calls (``batch_get_v1`` /
``batch_set_v1``, pages read and written in SGLang's host pool); without it the generic ones
(flat page copies). The ``kvstrata_`` options: :class:`StorageSettings`.

* :mod:`~kvstrata.integrations.sglang.storage`: :class:`KVStrataHiCacheStorage`, the class SGLang loads.
* :mod:`~kvstrata.integrations.sglang.pages`: SGLang's host pool pages as kvstrata blocks.
* :mod:`~kvstrata.integrations.sglang.settings`: the extra config, parsed.
* :mod:`~kvstrata.integrations.sglang.harness`: SGLang's host pools and controller on a CPU, for
  tests and benchmarks.
* :mod:`~kvstrata.integrations.sglang.cpu_torchvision`: lets SGLang import on a CPU torch.
"""

from kvstrata.integrations.sglang.cpu_torchvision import define_torchvision_ops

define_torchvision_ops()  # before SGLang's imports reach torchvision (a no-op on a CUDA torch)

from kvstrata.integrations.sglang.pages import HostPages, PoolGeometry  # noqa: E402
from kvstrata.integrations.sglang.settings import StorageSettings  # noqa: E402
from kvstrata.integrations.sglang.storage import KVStrataHiCacheStorage  # noqa: E402

__all__ = ["HostPages", "KVStrataHiCacheStorage", "PoolGeometry", "StorageSettings", "define_torchvision_ops"]
