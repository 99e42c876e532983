"""kvstrata: a hardware-aware, tiered KV cache for LLM inference.

Units, said once: bandwidth in decimal GB/s (1 GB = 1e9 bytes, as vendor datasheets use),
capacity in decimal GB unless a name says GiB, time in seconds. Names carry their unit
(``size_bytes``, ``bw_gbps``, ``latency_s``).
"""

__version__ = "0.1.0"
