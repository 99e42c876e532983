"""The token ids a request's blocks are keyed by: its prompt's, with what else its KV depends on
folded in.

kvstrata's keys chain token ids (:mod:`kvstrata.index.keys`). A request's KV can depend on more:
a LoRA adapter (its K and V projections are the adapter's), multimodal inputs (an image's
placeholder tokens say nothing of the image), a cache salt (its tenant asked for a prefix cache of
its own). vLLM puts these in its own block hashes (``generate_block_hash_extra_keys``: the
adapter's name and path, each item's identifier and position, the salt); here they are folded
into the ids of the prompt's first block (:func:`~kvstrata.index.keys.fold_extras`), so every key
of such a request differs from a plain prompt's and from another adapter's, tenant's or image's,
and two requests with the same extras share their blocks. A request with prompt embeddings has
no token ids to key: it is neither loaded into nor stored from.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from kvstrata.index.keys import fold_extras

if TYPE_CHECKING:
    from vllm.v1.request import Request


def extras_of(request: Request) -> list[list[object]]:
    """What besides its token ids the request's KV depends on, as vLLM's block hashes name it
    (empty: nothing)."""
    extras: list[list[object]] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extras.append(["lora", lora.lora_name, getattr(lora, "lora_path", None) or ""])
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        extras.append(["mm", str(feature.identifier), int(position.offset), int(position.length)])
    salt = getattr(request, "cache_salt", None)
    if salt:
        extras.append(["cache_salt", str(salt)])
    return extras


def key_tokens(request: Request, block_size: int) -> list[int] | None:
    """The ids the request's blocks are keyed by (None: it is not cached by kvstrata: prompt
    embeddings, or a first block whose ids leave no room to fold its extras into)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    tokens = list(request.prompt_token_ids or [])
    extras = extras_of(request)
    if not extras:
        return tokens
    return fold_extras(tokens, block_size, json.dumps(extras, separators=(",", ":")).encode())
