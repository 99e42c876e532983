"""What the SGLang storage tests share: tiny model shapes, and a page's KV read through SGLang's
own page accessor (so a page is compared across host layouts without kvstrata's page views).

Imported first by every test module here: where SGLang is not installed, the module skips.
Whether it is installed is read from its package metadata, not by importing it (SGLang's import
reaches PyPI's CUDA torchvision, which needs kvstrata's shim first), so that a failing import in
``.venv-sglang`` fails rather than skips.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

try:
    SGLANG_VERSION = importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("SGLang is not installed here (its tests run in .venv-sglang: bash .ci/sglang-venv)",
                allow_module_level=True)

from kvstrata.integrations.sglang import harness  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402  (after kvstrata's shim)

DISK_BYTES = 1 << 24
REMOTE_BYTES = 1 << 22
PAGE = 4  # tokens a page
MHA = harness.HostShape.mha(layers=3, heads=2, head_dim=8, page_size=PAGE)
MLA = harness.HostShape.mla(layers=3, kv_lora_rank=16, qk_rope_head_dim=8, page_size=PAGE)
SHAPES = {"mha": MHA, "mla": MLA}
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def page_kv(host, slot: int) -> torch.Tensor:
    """The page at host slot ``slot`` as ``[layers, kv, tokens, heads, bytes a head]`` (uint8, a
    copy), from SGLang's ``get_data_page(flat=False)`` in each layout's own axes."""
    page = host.get_data_page(slot, flat=False)
    if isinstance(host, MLATokenToKVPoolHost):
        # MLA: layer_first [L, P, 1, D], page_first [P, L, 1, D], page_first_direct [1, L, P, 1, D]
        kv = {"layer_first": page, "page_first": page.transpose(0, 1), "page_first_direct": page[0]}[host.layout]
        kv = kv.unsqueeze(1)
    else:
        # MHA: layer_first [2, L, P, H, D], page_first [2, P, L, H, D], page_first_direct [2, 1, L, P, H, D]
        kv = {"layer_first": page, "page_first": page.transpose(1, 2), "page_first_direct": page[:, 0]}[host.layout]
        kv = kv.transpose(0, 1)
    return kv.contiguous().view(torch.uint8).clone()


def pages_kv(host, indices: torch.Tensor) -> list[torch.Tensor]:
    return [page_kv(host, slot) for slot in indices[:: host.page_size].tolist()]


def same_pages(host_a, indices_a: torch.Tensor, host_b, indices_b: torch.Tensor) -> bool:
    a, b = pages_kv(host_a, indices_a), pages_kv(host_b, indices_b)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def block_files(directory: str | Path) -> list[Path]:
    return sorted(Path(directory).rglob("*.kvb"))
