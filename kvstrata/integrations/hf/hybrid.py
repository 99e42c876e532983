"""Greedy generation with a hybrid transformers model whose prompt's prefix comes from a GroupedCache.

:class:`HybridLM` is :class:`~kvstrata.integrations.hf.generate.KVStrataLM`'s counterpart for
models of several KV groups (sliding + full attention, linear attention + full attention; see
:mod:`kvstrata.integrations.hf.groups`). For a prompt it looks up the longest prefix every group
can resume from (:meth:`GroupedCache.lookup`), loads it, and fills a transformers
``DynamicCache`` with it layer by layer:

* a full-attention layer gets the prefix's K and V;
* a sliding-window layer gets the loaded window (the blocks overlapping the last
  ``sliding_window`` tokens; it attends to the last ``sliding_window - 1`` of them) and its
  token count, the prefix's length;
* a linear-attention layer gets its conv and recurrent states from the snapshot.

Then the rest of the prompt is computed. A recurrent state exists only after the tokens it has
seen, so snapshots are taken while computing: the prefill is split at each block boundary a
later lookup should resume from (the prompt's last full block short of its last token, which
is where the same prompt asked again hits, and the last full block of everything computed,
which is where the next turn of a conversation hits), and decode snapshots at the boundary it
crosses. Sliding layers record their whole past in this generation (transformers'
``activate_past_recording``: they compute the same, over the same window) so that the
window's blocks at each of those boundaries can be stored; the store writes only those
(:meth:`GroupedCache.store`).

The whole restore is waited for before the first layer runs (a dense model's restore overlaps
layers: KVStrataLM); a restore that fails (a block failing verification, a tier down) is
recomputed, never served. One sequence at a time (batch 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvstrata.cache.grouped import GroupedCache, GroupedLoad, GroupedLoadResult, GroupedStoreResult, GroupKV
from kvstrata.integrations.hf.cache import cache_arg
from kvstrata.integrations.hf.groups import hybrid_groups, layer_kinds, linear_state
from kvstrata.kv.groups import GroupKind

_RESTORE_WAIT_S = 120.0


@dataclass
class HybridGeneration:
    """One greedy generation of a hybrid model and what the cache did for it.

    Attributes:
        tokens: the generated token ids.
        first_logits: logits of the first generated token (float32, on the CPU).
        seconds: the whole generation.
        hit_tokens: prompt tokens resumed from the cache (not recomputed).
        load: per group, what the restore moved (None without a hit).
        stored: per group, what the store wrote (None when not storing).
        snapshots: the prefix lengths whose state this generation snapshotted.
    """

    tokens: list[int]
    first_logits: torch.Tensor
    seconds: float
    hit_tokens: int = 0
    load: GroupedLoadResult | None = None
    stored: GroupedStoreResult | None = None
    snapshots: tuple[int, ...] = ()


class HybridLM:
    """Greedy generation with a hybrid transformers causal LM over a :class:`GroupedCache`
    whose groups are :func:`~kvstrata.integrations.hf.groups.hybrid_groups` of the model (checked)."""

    def __init__(self, model: Any, cache: GroupedCache | None, tenant: str = "") -> None:
        self.model = model
        self.cache = cache
        self.tenant = tenant
        self._cache_arg = cache_arg(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kinds = layer_kinds(model.config)
        groups = hybrid_groups(model.config, self.dtype)
        if cache is not None and cache.config.groups != groups:
            raise ValueError(f"cache groups {[g.describe() for g in cache.config.groups]} do not fit the model's "
                             f"{[g.describe() for g in groups]}")
        self.state = linear_state(model.config, self.dtype) if any(g.kind is GroupKind.STATE for g in groups) else None
        # Per group name: the group and its layers; per layer: (group name, its row in the group's blocks).
        names = cache.config.names if cache is not None else tuple(f"g{i}" for i in range(len(groups)))
        self.groups = dict(zip(names, groups))
        self.where = {layer: (name, row) for name, g in self.groups.items() for row, layer in enumerate(g.layers)}

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int, *, reuse: bool = True, store: bool = True
                 ) -> HybridGeneration:
        """Greedy generation of ``max_new_tokens`` after ``prompt`` (see the module text).

        Args:
            reuse: look up and resume from the cached prefix (False: a cold run).
            store: store the groups' blocks and the state snapshots when done.
        """
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        start = time.perf_counter()
        caching = self.cache is not None
        kv_cache = DynamicCache(config=self.model.config)
        hit, load, starts = 0, None, dict.fromkeys(self.groups, 0)
        if reuse and caching:
            match = self.cache.lookup(prompt[:-1], self.tenant)
            try:
                if match.tokens:
                    with self.cache.load(match) as loaded:
                        load = loaded.wait(_RESTORE_WAIT_S)
                        self._restore(kv_cache, loaded, match.tokens)
                    hit = match.tokens
                    starts = {name: part.first_block * match.block_tokens for name, part in match.groups.items()}
            except Exception:  # noqa: BLE001 - a failed restore is recomputed, never served
                kv_cache, load = DynamicCache(config=self.model.config), None
        self._record_windows(kv_cache)
        block = self.cache.block_tokens if caching else 1
        computed = len(prompt) + max_new_tokens - 1  # the last token's KV is never computed
        points = sorted({(len(prompt) - 1) // block * block, computed // block * block} - {0}) if caching and store else []
        snapshots: dict[int, dict[str, torch.Tensor]] = {}
        done = hit
        for cut in [p for p in points if hit < p < len(prompt)] + [len(prompt)]:
            logits = self._forward(prompt[done:cut], kv_cache)
            done = cut
            self._snapshot(kv_cache, done, points, snapshots)
        first_logits = logits.float().cpu()
        tokens = [int(logits.argmax())]
        while len(tokens) < max_new_tokens:
            logits = self._forward(tokens[-1:], kv_cache)
            done += 1
            self._snapshot(kv_cache, done, points, snapshots)
            tokens.append(int(logits.argmax()))
        stored = None
        if caching and store:
            kv = {name: GroupKV(self._group_kv(kv_cache, name), starts[name])
                  for name, g in self.groups.items() if g.kind.per_token}
            stored = self.cache.store(list(prompt) + tokens[:-1], kv, snapshots, hits=points,
                                      tenant=self.tenant).result()
        return HybridGeneration(tokens, first_logits, time.perf_counter() - start, hit, load, stored,
                                tuple(sorted(snapshots)))

    def _forward(self, ids: list[int], kv_cache: DynamicCache) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([ids], device=self.device), **{self._cache_arg: kv_cache},
                         use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def _record_windows(self, kv_cache: DynamicCache) -> None:
        """Sliding layers keep their whole past in this generation (to store the windows)."""
        if self.cache is None:
            return
        for layer in kv_cache.layers:
            if getattr(layer, "is_sliding", False):
                layer.activate_past_recording()

    def _restore(self, kv_cache: DynamicCache, loaded: GroupedLoad, tokens: int) -> None:
        """Fill every layer of ``kv_cache`` from the loaded groups, as if ``tokens`` had been computed."""
        kv = {name: loaded.kv(name) for name, g in self.groups.items() if g.kind.per_token}
        states = {name: loaded.state(name) for name, g in self.groups.items() if g.kind is GroupKind.STATE}
        for i, layer in enumerate(kv_cache.layers):
            name, row = self.where[i]
            if name in states:
                conv, recurrent = self.state.unpack(states[name][row], self.device)
                layer.lazy_initialization(conv_states=conv, recurrent_states=recurrent, conv_kernel_size=self.state.kernel)
                layer.conv_states[0].copy_(conv)
                layer.recurrent_states[0].copy_(recurrent)
                layer.has_previous_state[0] = True
                continue
            blocks = kv[name][row].to(self.device)  # [2, tokens, kv_heads, head_dim]
            keys, values = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in blocks)  # [1, H, T, D]
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            if layer.is_sliding:
                layer.cumulative_length = tokens

    def _snapshot(self, kv_cache: DynamicCache, done: int, points: list[int], out: dict) -> None:
        """At a snapshot point, every STATE group's state after ``done`` tokens."""
        if done not in points or self.state is None:
            return
        out[done] = {name: torch.stack([self.state.pack(kv_cache.layers[i].conv_states[0],
                                                        kv_cache.layers[i].recurrent_states[0]) for i in g.layers])
                     for name, g in self.groups.items() if g.kind is GroupKind.STATE}

    def _group_kv(self, kv_cache: DynamicCache, name: str) -> torch.Tensor:
        """A per-token group's KV as ``[layers, 2, tokens, kv_heads, head_dim]``."""
        layers = [kv_cache.layers[i] for i in self.groups[name].layers]
        per_layer = [torch.stack([layer.keys[0], layer.values[0]]) for layer in layers]  # [2, H, T, D]
        return torch.stack(per_layer).permute(0, 1, 3, 2, 4).contiguous()
