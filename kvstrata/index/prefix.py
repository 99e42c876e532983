"""The prefix index: which tiers hold each block, and the longest cached prefix of a sequence.

Two dicts keyed by block key, kept in step under one lock: the bitmask of the media holding the
block READY, and the fastest of them. The block manager keeps them in step with every tier's
block table (it adds a medium when a block becomes READY there, removes it when the block
leaves). A lookup is one probe per block of the second dict, in C (``map``), up to the first
miss; its values are the match's media as they stand, so no block costs Python bytecode. A
probe costs the same at 1K and 1M entries but for the CPU cache misses of a bigger table
(``kvstrata bench lookup`` measures both).

A listener (:meth:`PrefixIndex.listen`, one at most) is told of every change: a medium that
comes to hold a key READY, or stops holding it; a call that changes nothing (a key added where
it is, discarded where it is not) tells it nothing. It is called under the index's lock, in the
order of the changes, so what it hears is the index's history; it must not call the index back.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from kvstrata.index.keys import BlockKey
from kvstrata.media import FASTEST_BY_MASK, Medium


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a sequence's blocks.

    Attributes:
        keys: the keys of the matched blocks, in order.
        media: per matched block, the fastest medium holding it.
        block_size: tokens per block.
        total_blocks: full blocks in the looked-up sequence.
    """

    keys: tuple[BlockKey, ...]
    media: tuple[Medium, ...]
    block_size: int
    total_blocks: int

    @property
    def blocks(self) -> int:
        return len(self.keys)

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    def cut(self, blocks: int) -> "Match":
        """The first ``blocks`` blocks of this match (what every rank of an instance has)."""
        return Match(self.keys[:blocks], self.media[:blocks], self.block_size, self.total_blocks)

    def after(self, blocks: int) -> "Match":
        """This match less its first ``blocks`` blocks (what a split loads while those compute)."""
        return Match(self.keys[blocks:], self.media[blocks:], self.block_size, self.total_blocks)

    def count(self, medium: Medium) -> int:
        return self.counts.get(medium, 0)

    @cached_property
    def counts(self) -> dict[Medium, int]:
        """Matched blocks per fastest medium, media with none left out."""
        # By runs: a prefix is one run or a few (device blocks, then host, then disk). One run is
        # a tuple.count (identity compares, in C); a few are walked by groupby, in C, ~20 ns a
        # block, where hashing each Medium for a Counter costs ~50. Past RUNS_COUNTED runs (media
        # interleaved block by block) a Counter.
        if not self.media:
            return {}
        first = self.media[0]
        if self.media[-1] is first and self.media.count(first) == len(self.media):  # one run: a few ns a block
            return {first: len(self.media)}
        counts: dict[Medium, int] = {}
        for i, (medium, run) in enumerate(itertools.groupby(self.media)):
            if i == RUNS_COUNTED:
                return dict(collections.Counter(self.media))
            counts[medium] = counts.get(medium, 0) + len(list(run))
        return counts


RUNS_COUNTED = 64


class IndexListener(Protocol):
    """Told of each change of a :class:`PrefixIndex` (see the module text)."""

    def changed(self, medium: Medium, keys: Sequence[BlockKey], held: bool) -> None:
        """``keys`` are now READY on ``medium`` (``held``), or no longer are."""


class PrefixIndex:
    """Where each block is READY (see the module text); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mask: dict[BlockKey, int] = {}  # never 0: a key on no medium is not in either dict
        self._fastest: dict[BlockKey, Medium] = {}  # FASTEST_BY_MASK[self._mask[key]], same keys
        self._listener: IndexListener | None = None

    def listen(self, listener: IndexListener) -> None:
        """Tell ``listener`` of every change from now on, after telling it, per medium, the keys
        held now (as held: so its view starts as the index's).

        Raises:
            ValueError: a listener is already set.
        """
        with self._lock:
            if self._listener is not None:
                raise ValueError("the prefix index already has a listener")
            self._listener = listener
            for medium in Medium:
                held = [key for key, mask in self._mask.items() if mask & medium.bit]
                if held:
                    listener.changed(medium, held, True)

    def add(self, key: BlockKey, medium: Medium) -> None:
        with self._lock:
            before = self._mask.get(key, 0)
            mask = before | medium.bit
            self._mask[key] = mask
            self._fastest[key] = FASTEST_BY_MASK[mask]
            if self._listener is not None and mask != before:
                self._listener.changed(medium, (key,), True)

    def add_many(self, keys: list[BlockKey], medium: Medium) -> None:
        """:meth:`add` of each of ``keys`` (recovery adopts a whole tier at once)."""
        with self._lock:
            mask_of, fastest = self._mask, self._fastest
            new = []
            for key in keys:
                before = mask_of.get(key, 0)
                mask = before | medium.bit
                mask_of[key] = mask
                fastest[key] = FASTEST_BY_MASK[mask]
                if mask != before:
                    new.append(key)
            if self._listener is not None and new:
                self._listener.changed(medium, new, True)

    def discard(self, key: BlockKey, medium: Medium) -> None:
        with self._lock:
            before = self._mask.get(key, 0)
            mask = before & ~medium.bit
            if mask:
                self._mask[key] = mask
                self._fastest[key] = FASTEST_BY_MASK[mask]
            else:
                self._mask.pop(key, None)
                self._fastest.pop(key, None)
            if self._listener is not None and mask != before:
                self._listener.changed(medium, (key,), False)

    def media(self, key: BlockKey) -> tuple[Medium, ...]:
        with self._lock:
            return Medium.from_mask(self._mask.get(key, 0))

    def match(self, keys: list[BlockKey], block_size: int) -> Match:
        fastest = self._fastest
        with self._lock:
            try:  # a probe a block, in C; a miss stops it, and nothing past the miss is probed
                return Match(tuple(keys), tuple(map(fastest.__getitem__, keys)), block_size, len(keys))
            except KeyError as miss:
                n = keys.index(miss.args[0])  # the first miss: every earlier key was found
                return Match(tuple(keys[:n]), tuple(map(fastest.__getitem__, keys[:n])), block_size, len(keys))

    def __len__(self) -> int:
        with self._lock:
            return len(self._mask)
