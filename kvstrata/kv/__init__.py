"""KV geometry: bytes of KV per token from a model config, and the built-in model presets."""

from kvstrata.kv.geometry import Attention, DType, GeometryError, KVGeometry
from kvstrata.kv.readconfig import KVShape, geometry_from_config, kv_shape_from_config
from kvstrata.kv.params import ParamCount
from kvstrata.kv.presets import list_presets, load_config, load_geometry, load_source

__all__ = [
    "Attention",
    "DType",
    "GeometryError",
    "KVGeometry",
    "KVShape",
    "ParamCount",
    "geometry_from_config",
    "kv_shape_from_config",
    "list_presets",
    "load_config",
    "load_geometry",
    "load_source",
]
