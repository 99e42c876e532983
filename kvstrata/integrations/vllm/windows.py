"""Which of vLLM's blocks a step's plans name, per KV cache group: the blocks each window reaches.

vLLM's block ids come per KV cache group. A sliding or chunked group holds only the blocks its
window reaches: those before it are vLLM's null block, never loaded into or saved from. A load
fills each group's blocks of the hit that vLLM allocated (a sliding group's: its window before
the hit's end; :func:`load_window`). A save stores every block of a full group, and of a
windowed group only the blocks of the windows before the two ends a later lookup may hit: the
saved prefix's end and one block short of it (a prompt asked again stops before its last token;
:func:`save_window`). Blocks out of those windows are never written down
(:mod:`kvstrata.cache.grouped`'s rule; a block's key chains from the first block's tokens, not
from stored blocks, so a window stands alone), which also lets a prompt prefilled in chunks,
whose early sliding blocks vLLM dropped, store its windows.
"""

from __future__ import annotations

from kvstrata.integrations.vllm.metadata import GroupBlocks


def load_window(ids: list[int], first: int, null: int) -> GroupBlocks:
    """A group's blocks ``first ..`` of a load, its leading null blocks (before its window) left out.

    vLLM drops a sliding or chunked group's blocks from the front only: past the first real
    block every block of the hit is real.
    """
    skipped = next((i for i, b in enumerate(ids) if b != null), len(ids))
    window = ids[skipped:]
    if null in window:
        raise ValueError(f"KVStrataConnector: vLLM's blocks {ids} for a load have a null block inside the window")
    return GroupBlocks(first + skipped, window)


def save_window(ids: list[int], span: int | None, block_size: int, null: int) -> GroupBlocks:
    """The blocks of a group to save of a prefix of ``len(ids)`` blocks: all of a full group's
    (up to a block vLLM dropped), a windowed group's (``span`` tokens) overlapping the window
    before the prefix's end or one block short of it, of those vLLM still holds."""
    if span is None:
        end = next((i for i, b in enumerate(ids) if b == null), len(ids))
        return GroupBlocks(0, ids[:end])
    first = max(0, (len(ids) - 1) * block_size - span) // block_size
    held = load_window(ids[first:], first, null)
    return held if held.block_ids else GroupBlocks(0, [])
