"""The hardware model: a pure catalog of devices, topologies built from profiles, and paths.

Nothing here imports torch or touches a device; only ``profile`` reads files (the loader edge).
"""
