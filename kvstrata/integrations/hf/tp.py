"""A transformers model under tensor parallelism: which rank this process is, and what its ranks agree on.

transformers' own tensor parallelism (``from_pretrained(..., distributed_config=
DistributedConfig(tp_size=t))``, or the older ``tp_plan="auto"``) shards each attention by
heads over ``torch.distributed``: rank r of t computes, and its ``DynamicCache`` holds, KV heads
``[r*H/t, (r+1)*H/t)`` (:meth:`kvstrata.kv.heads.HeadSlicing.rank_heads`). A kvstrata cache for
such a model is per rank: head-sliced (:func:`~kvstrata.integrations.hf.cache.model_slice_layout`,
the same stored slices for every TP size) or TP-matched (the rank's whole blocks, its namespace
naming the rank).

Every rank runs the same forward passes, each of which all-reduces across ranks: the ranks must
restore the same number of tokens, or their forwards diverge and hang. A prefix is therefore a
hit for the instance only as far as every rank has it, :meth:`TensorParallel.agree` (an
``all_reduce(MIN)``) making each rank's count the instance's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of a ``size``-way tensor-parallel model.

    Attributes:
        size: ranks of the model (1: not parallel).
        rank: this process's rank among them.
        group: the ranks' ``torch.distributed`` process group; None: the default group.
    """

    size: int = 1
    rank: int = 0
    group: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensor parallel size must be a positive integer, got {self.size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank must be in [0, {self.size}), got {self.rank!r}")

    @classmethod
    def of_model(cls, model: Any) -> "TensorParallel":
        """The model's own tensor parallelism: its ``tp_size`` (None or 1 when transformers did not
        shard it) and this process's rank on its device mesh's ``tp`` dimension."""
        size = getattr(model, "tp_size", None) or 1
        if size == 1:
            return cls()
        mesh = getattr(model, "_device_mesh", None)
        if mesh is not None and mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names:
            tp_mesh = mesh["tp"] if mesh.ndim > 1 else mesh
            return cls(size, tp_mesh.get_local_rank(), tp_mesh.get_group())
        import torch.distributed as dist

        return cls(size, dist.get_rank())

    def agree(self, value: int, device: torch.device) -> int:
        """The least of every rank's ``value`` (each rank calls this with its own, at the same
        point): what all of them can do. One all-reduce on ``device`` (a GPU for NCCL)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())
