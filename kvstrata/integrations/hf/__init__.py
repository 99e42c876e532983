"""A transformers model on kvstrata: prefix reuse from any tier, layer by layer, and DRAM streaming.

By role:

* :mod:`~kvstrata.integrations.hf.cache`: the transformers ``Cache`` adapter
  (:class:`KVStrataCache`, whose :class:`RestoringLayer` s append a :class:`RestoredPrefix`
  layer by layer as it arrives), :func:`model_layout`, a model's kvstrata block layout (a
  rank's whole blocks), and :func:`model_slice_layout`, that of one head slice of them (one
  stored copy for every tensor-parallel size).
* :mod:`~kvstrata.integrations.hf.tp`: :class:`TensorParallel`, a rank of a model under
  transformers' own tensor parallelism, and the ranks' agreement on what they restore.
* :mod:`~kvstrata.integrations.hf.streaming`: per-step DRAM streaming decode
  (:class:`StreamedKV`, :class:`StreamingLayer`): the KV lives in host memory and each layer's
  crosses to the device just before the layer runs.
* :mod:`~kvstrata.integrations.hf.generate`: :class:`KVStrataLM`, greedy generation that looks
  up, loads, recomputes or splits the cached prefix and stores what it computed, and
  :class:`Generation`, what one generation did.
* :mod:`~kvstrata.integrations.hf.hybrid`: :class:`HybridLM`, the same for hybrid models (sliding
  windows, linear-attention state) over a :class:`~kvstrata.cache.grouped.GroupedCache`, their
  groups read by :func:`~kvstrata.integrations.hf.groups.hybrid_groups`.

The load-time predictions behind ``strategy="auto"`` are pure and live in
:mod:`kvstrata.plan.loadtime`.
"""

from kvstrata.integrations.hf.cache import (KVStrataCache, RestoredPrefix, RestoringLayer, model_layout,
                                            model_slice_layout)
from kvstrata.integrations.hf.generate import Generation, KVStrataLM
from kvstrata.integrations.hf.groups import hybrid_groups
from kvstrata.integrations.hf.hybrid import HybridGeneration, HybridLM
from kvstrata.integrations.hf.streaming import StreamedKV, StreamingLayer
from kvstrata.integrations.hf.tp import TensorParallel

__all__ = [
    "Generation",
    "HybridGeneration",
    "HybridLM",
    "KVStrataCache",
    "KVStrataLM",
    "RestoredPrefix",
    "RestoringLayer",
    "StreamedKV",
    "StreamingLayer",
    "TensorParallel",
    "hybrid_groups",
    "model_layout",
    "model_slice_layout",
]
