"""Lets SGLang's import chain load PyPI's torchvision on a CPU build of torch.

SGLang's memory pools import its model configs, which import ``torchvision.transforms``. PyPI's
torchvision wheel for torch 2.13 is a CUDA build: on a CPU torch its ``_C`` library does not load,
which torchvision tolerates, and then ``torchvision/_meta_registrations.py`` registers fake
kernels for ``torchvision::nms`` and ``torchvision::qnms`` without checking that the library
loaded, and the import fails ("operator torchvision::nms does not exist"). Defining the two op
schemas first (no kernels: nothing on SGLang's storage path calls them) lets the import through.
A CUDA torch, or a torchvision already imported, is left as it is.
"""

from __future__ import annotations

import importlib.util
import sys

_LIBRARY = None  # the schemas' registration, kept alive


def define_torchvision_ops() -> None:
    """Define ``torchvision::nms`` and ``torchvision::qnms`` where a CPU torch would lack them."""
    global _LIBRARY
    if _LIBRARY is not None or "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        return
    import torch

    if torch.version.cuda is not None:
        return
    try:
        library = torch.library.Library("torchvision", "FRAGMENT")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:  # defined already (a torchvision whose library loaded)
        return
    _LIBRARY = library
