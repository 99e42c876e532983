"""One rank of the tiny model under transformers' own tensor parallelism (gloo, CPU), for test_hf_tp.py.

:func:`rank_main` is spawned once per rank (``torch.multiprocessing``, spawn): it joins a gloo
process group, loads the model with ``DistributedConfig(tp_size=world)`` (each rank's attention
and DynamicCache hold its KV heads), and runs one scripted session over a head-sliced cache
whose shared tier is the pool. It puts one dict on the queue: what it generated, what it looked
up, and the KV it reads back, as numpy arrays (by value), or ``{"error": traceback}``.
"""

from __future__ import annotations

import os
import traceback

import torch

BLOCK = 16
NEW_TOKENS = 8
DTYPE = torch.float32  # one reduction order away from TP=1's logits; greedy tokens must match


def make_cache(model, model_id: str, pool):
    """A head-sliced cache of the model (device + host here, the pool shared), written through."""
    from kvstrata.cache import CacheConfig, TieredCache
    from kvstrata.integrations.hf import model_slice_layout
    from kvstrata.policies.write import WritePolicy, WriteRule

    layout = model_slice_layout(model.config, BLOCK, DTYPE)
    b = layout.block_bytes
    return TieredCache(CacheConfig(layout, model_id, device_bytes=256 * b, host_bytes=256 * b, device="cpu",
                                   pool=pool, remote_bytes=256 * b, write=WriteRule(WritePolicy.WRITE_THROUGH)))


def read_back(lm, tokens: list[int]):
    """The rank's KV of ``tokens``' cached blocks, ``[layers, 2, tokens, its heads, head_dim]``."""
    match = lm.kv.lookup(tokens)
    with lm.kv.load(match) as load:
        load.wait(60)
        return match.blocks, load.kv().numpy().copy()


def rank_main(rank: int, world: int, port: int, model_dir: str, model_id: str, pool, restore: list[int],
              store: list[int], partial: list[int], queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on a shared CPU
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put(session(rank, world, model_dir, model_id, pool, restore, store, partial))
    except BaseException:  # noqa: BLE001 - the test reads it
        queue.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@torch.inference_mode()
def session(rank: int, world: int, model_dir: str, model_id: str, pool, restore: list[int], store: list[int],
            partial: list[int]) -> dict:
    """Restore ``restore``'s prefix (stored by TP=1) next to a cold run of it; store ``store``'s;
    restore ``partial``'s, whose blocks the ranks hold unequally."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from kvstrata.integrations.hf import KVStrataLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE, distributed_config=DistributedConfig(tp_size=world))
    with make_cache(model, model_id, pool) as cache:
        lm = KVStrataLM(model, cache)
        out = {"rank": rank, "tp": (lm.tp.size, lm.tp.rank), "heads": (lm.kv.heads.start, lm.kv.heads.stop)}
        out["own_blocks"] = lm.kv.lookup(restore[:-1]).blocks  # this rank's slices, before the ranks agree
        cold = lm.generate(restore, NEW_TOKENS, reuse=False, store=False)
        warm = lm.generate(restore, NEW_TOKENS, store=False)
        out.update(cold=cold.tokens, warm=warm.tokens, hit_tokens=warm.hit_tokens)
        out["restored_blocks"], out["restored_kv"] = read_back(lm, restore[:-1])
        stored = lm.generate(store, NEW_TOKENS, reuse=False)
        out.update(store_tokens=stored.tokens, stored_blocks=stored.stored_blocks)
        out["stored_read_blocks"], out["stored_kv"] = read_back(lm, store[:-1])
        out["partial_own_blocks"] = lm.kv.lookup(partial[:-1]).blocks
        uneven = lm.generate(partial, NEW_TOKENS, store=False)
        out.update(partial_tokens=uneven.tokens, partial_hit_tokens=uneven.hit_tokens)
    return out
