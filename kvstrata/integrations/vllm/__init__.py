"""A vLLM V1 KV connector backed by kvstrata's TieredCache.

Load it with::

    kv_transfer_config={
        "kv_connector": "KVStrataConnector",
        "kv_connector_module_path": "kvstrata.integrations.vllm",
        "kv_role": "kv_both",  # or kv_producer (prefill) / kv_consumer (decode)
        "kv_load_failure_policy": "recompute",  # a block that fails to load is recomputed
        "kv_connector_extra_config": {"host_bytes": 1 << 30, "disk_dir": "...", "disk_bytes": 8 << 30},
    }

Roles and processes. vLLM builds a scheduler-side connector (in the engine core) and a
worker-side one (in each worker). The worker owns its process's TieredCaches, one per KV cache
group of the model (one for a dense model; a sliding-window hybrid has a full and a sliding
group): it moves every byte. The scheduler asks it how long a prompt's cached prefix is: directly when both live
in one process, else over a Unix socket the worker serves.

By role:

* :mod:`~kvstrata.integrations.vllm.connector`: :class:`KVStrataConnector`, the class vLLM
  loads; it builds its role's half and delegates every hook to it.
* :mod:`~kvstrata.integrations.vllm.scheduler`: lookups, grants, and each step's load and save
  plans (:mod:`~kvstrata.integrations.vllm.metadata`; the blocks each group's windows reach:
  :mod:`~kvstrata.integrations.vllm.windows`).
* :mod:`~kvstrata.integrations.vllm.worker`: the TieredCaches over vLLM's paged KV (what is
  cached, byte by byte, is told there), composed of
  :mod:`~kvstrata.integrations.vllm.loads` (loads in the step and off it, and load failures),
  :mod:`~kvstrata.integrations.vllm.saves` (staging, the copy out after the step, the stores),
  :mod:`~kvstrata.integrations.vllm.probes` (probe reads of declined tiers) and
  :mod:`~kvstrata.integrations.vllm.reporting` (the counters' reports, the connector's CPU).
* :mod:`~kvstrata.integrations.vllm.groups`: vLLM's KV cache groups as kvstrata's, and the
  usable hit over them.
* :mod:`~kvstrata.integrations.vllm.channel`: the scheduler's lookup, in-process or over a socket
  private to this user (no pickle, bounded in time).
* :mod:`~kvstrata.integrations.vllm.settings`: ``kv_connector_extra_config``, parsed.
* :mod:`~kvstrata.integrations.vllm.stats`: the worker's counters, written as JSON.
* :mod:`~kvstrata.integrations.vllm.prom`: the same counters, the lookups' and the tiers' fill
  on vLLM's own ``/metrics`` (``kvstrata_connector_*``), through vLLM's connector-stats hooks.
"""

from kvstrata.integrations.vllm.connector import KVStrataConnector
from kvstrata.integrations.vllm.groups import VLLMGroup, group_spans, vllm_groups
from kvstrata.integrations.vllm.metadata import GroupBlocks, KVStrataMetadata, LoadSpec, SaveSpec
from kvstrata.integrations.vllm.scheduler import KVStrataConnectorScheduler
from kvstrata.integrations.vllm.settings import ConnectorSettings
from kvstrata.kv.heads import KVSharing
from kvstrata.integrations.vllm.worker import KVStrataConnectorWorker

__all__ = [
    "ConnectorSettings",
    "KVSharing",
    "GroupBlocks",
    "KVStrataConnector",
    "KVStrataConnectorScheduler",
    "KVStrataConnectorWorker",
    "KVStrataMetadata",
    "LoadSpec",
    "SaveSpec",
    "VLLMGroup",
    "group_spans",
    "vllm_groups",
]
