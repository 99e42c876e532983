"""Recurrent layers' state sizes: what one ``linear_attention`` / ``conv`` / ``hybrid`` layer
caches per sequence, as transformers' cache holds it.

Each rule follows its modeling code's cache shapes (cited at the rule): a convolution state in
the model's dtype and a recurrent (SSM / delta-rule) state in fp32. Pure: no torch, no transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from kvstrata.kv.dtypes import DType
from kvstrata.kv.fields import GeometryError, check_int

Section = Mapping[str, object]
"""A decoder's config fields (its family's defaults filled in), as parsed from ``config.json``."""


def int_field(section: Section, key: str, minimum: int = 1) -> int:
    """``section[key]``, an integer >= ``minimum``; the error names the field."""
    return check_int(f"config field {key!r}", section.get(key), minimum=minimum)


class StateKind(Enum):
    """How a family's state layers work."""

    MAMBA1 = "mamba1"  # Jamba's Mamba mixer
    MAMBA2 = "mamba2"  # Bamba, Granite-4.0-H, Falcon-H1, Nemotron-H
    GDN = "gdn"  # the gated delta net of Qwen3-Next / Qwen3.5
    CONV = "conv"  # LFM2's short convolution


@dataclass(frozen=True)
class StateSize:
    """One layer's fixed-size state for one sequence.

    Attributes:
        conv_elements: Elements of the convolution state (cached in the model's dtype).
        recurrent_elements: Elements of the recurrent (SSM / delta-rule) state, cached in fp32.
        heads: What the state splits by under tensor parallelism.
        model_dtype: The model's dtype (the conv state's).
    """

    conv_elements: int
    recurrent_elements: int
    heads: int
    model_dtype: DType

    @property
    def state_bytes(self) -> int:
        return self.conv_elements * self.model_dtype.size_bytes + self.recurrent_elements * DType.FP32.size_bytes

    @property
    def dtype(self) -> DType:
        """The dtype a state group is shown with: fp32 where a recurrent state dominates, else the conv's."""
        return DType.FP32 if self.recurrent_elements else self.model_dtype


def state_by_fields(section: Section) -> StateKind | None:
    """A model type without rules: its state kind from the fields it has."""
    if section.get("linear_key_head_dim") is not None:
        return StateKind.GDN
    if section.get("mamba_n_heads") is not None:
        return StateKind.MAMBA2
    if section.get("mamba_d_state") is not None:
        return StateKind.MAMBA1
    if section.get("conv_L_cache") is not None:
        return StateKind.CONV
    return None


def sized_state(state: StateKind, section: Section, model_dtype: DType) -> StateSize:
    """One layer's state of kind ``state``.

    Raises:
        GeometryError: a field the rule needs is missing or invalid.
    """
    return _STATE_RULES[state](section, model_dtype)


def _mamba1(section: Section, model_dtype: DType) -> StateSize:
    # transformers/models/jamba/modeling_jamba.py (JambaMambaMixer): intermediate_size =
    # mamba_expand * hidden_size; conv state [intermediate, mamba_d_conv] in the model's dtype,
    # recurrent (SSM) state [intermediate, mamba_d_state] in fp32 (the selective scan's last state).
    intermediate = int_field(section, "mamba_expand") * int_field(section, "hidden_size")
    conv = intermediate * int_field(section, "mamba_d_conv")
    ssm = intermediate * int_field(section, "mamba_d_state")
    return StateSize(conv, ssm, intermediate, model_dtype)


@dataclass(frozen=True)
class Mamba2:
    """A Mamba-2 mixer's dimensions, from whichever names its family uses."""

    heads: int
    head_dim: int
    groups: int
    state: int
    conv_kernel: int
    intermediate: int

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.groups * self.state


def mamba2_dims(section: Section) -> Mamba2:
    """The Mamba-2 mixer of Bamba, Granite-4.0-H, Falcon-H1 (``mamba_*`` fields) or Nemotron-H.

    Intermediate size: Nemotron-H ``mamba_num_heads * mamba_head_dim``; Falcon-H1 ``mamba_d_ssm``
    (else ``mamba_expand * hidden_size``); the others ``mamba_expand * hidden_size``. A head width
    of ``"auto"`` is the intermediate size over the heads.
    """
    if section.get("model_type") == "nemotron_h":
        heads, head_dim = int_field(section, "mamba_num_heads"), int_field(section, "mamba_head_dim")
        return Mamba2(heads, head_dim, int_field(section, "n_groups"), int_field(section, "ssm_state_size"),
                      int_field(section, "conv_kernel"), heads * head_dim)
    hidden = int_field(section, "hidden_size")
    heads = int_field(section, "mamba_n_heads")
    if section.get("mamba_d_ssm") is not None:
        intermediate = int_field(section, "mamba_d_ssm")
    else:
        intermediate = int_field(section, "mamba_expand") * hidden
    if section.get("mamba_d_head", "auto") == "auto":
        if intermediate % heads:
            raise GeometryError(f"config field 'mamba_n_heads' ({heads}) must divide the Mamba-2 width {intermediate}")
        head_dim = intermediate // heads
    else:
        head_dim = int_field(section, "mamba_d_head")
    return Mamba2(heads, head_dim, int_field(section, "mamba_n_groups"), int_field(section, "mamba_d_state"),
                  int_field(section, "mamba_d_conv"), intermediate)


def _mamba2(section: Section, model_dtype: DType) -> StateSize:
    # transformers/models/bamba/modeling_bamba.py (BambaMixer; Granite-4.0-H, Falcon-H1, Nemotron-H
    # alike): conv_dim = intermediate + 2 * n_groups * d_state; conv state [conv_dim, d_conv] in the
    # model's dtype, SSM state [num_heads, head_dim, d_state] in fp32.
    dims = mamba2_dims(section)
    return StateSize(dims.conv_dim * dims.conv_kernel, dims.heads * dims.head_dim * dims.state, dims.heads,
                     model_dtype)


def _gdn(section: Section, model_dtype: DType) -> StateSize:
    # transformers/models/qwen3_next/modeling_qwen3_next.py (Qwen3NextGatedDeltaNet): conv over
    # q, k and v, conv_dim = 2 * key_dim + value_dim (key_dim = linear_num_key_heads *
    # linear_key_head_dim, value_dim = linear_num_value_heads * linear_value_head_dim), state
    # [conv_dim, linear_conv_kernel_dim] in the model's dtype; recurrent state [linear_num_value_heads,
    # linear_key_head_dim, linear_value_head_dim] in fp32.
    key_heads, value_heads = int_field(section, "linear_num_key_heads"), int_field(section, "linear_num_value_heads")
    key_dim, value_dim = int_field(section, "linear_key_head_dim"), int_field(section, "linear_value_head_dim")
    if value_heads % key_heads:
        raise GeometryError(
            f"config field 'linear_num_value_heads' ({value_heads}) must be a multiple of "
            f"'linear_num_key_heads' ({key_heads})"
        )
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    conv = conv_dim * int_field(section, "linear_conv_kernel_dim")
    return StateSize(conv, value_heads * key_dim * value_dim, key_heads, model_dtype)


def _lfm2_conv(section: Section, model_dtype: DType) -> StateSize:
    # transformers/models/lfm2/modeling_lfm2.py (Lfm2ShortConv): a depthwise conv over hidden_size
    # channels, state [hidden_size, conv_L_cache] in the model's dtype; no recurrent state.
    hidden = int_field(section, "hidden_size")
    return StateSize(hidden * int_field(section, "conv_L_cache"), 0, hidden, model_dtype)


_STATE_RULES: dict[StateKind, Callable[[Section, DType], StateSize]] = {
    StateKind.MAMBA1: _mamba1,
    StateKind.MAMBA2: _mamba2,
    StateKind.GDN: _gdn,
    StateKind.CONV: _lfm2_conv,
}
