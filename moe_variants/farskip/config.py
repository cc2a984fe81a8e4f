"""FarSkip-Collective's config section: which layers, how they run, which sub-block skips.

Flags (flat, Megatron style; also YAML keys): ``--farskip none|all|first:N|last:N|A-B``,
``--farskip-impl simple|overlapped``, ``--farskip-mode full|attn-only|mlp-only``,
``--farskip-connectivity reference|paper-text``, ``--[no-]farskip-defer-wgrad``. The layer
selection is parsed once, here, into a :class:`LayerSelection`.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Optional

from moe_variants.config import coerce_enums
from moe_variants.registry import VariantConfig

__all__ = ["FarSkipConfig", "FarSkipConnectivity", "FarSkipImpl", "FarSkipMode", "LayerSelection"]


class FarSkipMode(str, enum.Enum):
    """Which sub-block of a FarSkip layer reads an earlier activation. ``full``: attention reads
    the stream without the last routed-expert output and the MoE reads the pre-attention residual
    (the paper). ``attn-only``: only attention skips. ``mlp-only``: only the MoE skips."""

    full = "full"
    attn_only = "attn-only"
    mlp_only = "mlp-only"


class FarSkipConnectivity(str, enum.Enum):
    """What the standard MoE layer right before a FarSkip range hands the range's first layer.

    ``reference``: the authors' wiring (their Instella-MoE modelling, docs/design/farskip.md): its
    routed-free stream as the attention stream and its full output as the full stream, so the
    first FarSkip layer's attention skips that layer's routed experts like every other FarSkip
    layer's. ``paper-text``: one collapsed stream (its full output), this project's first reading
    of the paper; checkpoints written before this option were trained with it. The two differ only
    for a range that starts right after an MoE layer (``last:N``, ``A-B``), and not in ``mlp-only``
    mode (whose attention reads the full stream anyway)."""

    reference = "reference"
    paper_text = "paper-text"


class FarSkipImpl(str, enum.Enum):
    """``simple``: FarSkip connectivity with blocking collectives (reference, fine-tuning).
    ``overlapped``: the same math with dispatch/combine overlapping attention and the next layer."""

    simple = "simple"
    overlapped = "overlapped"


@dataclasses.dataclass(frozen=True)
class LayerSelection:
    """The layers ``--farskip`` selects: ``none``, ``all``, ``first:N``, ``last:N`` or ``A-B``
    (0-based, inclusive). ``str()`` gives the flag's text back (what configs store)."""

    kind: str  # none | all | first | last | range
    a: int = 0
    b: int = 0

    @classmethod
    def parse(cls, text) -> "LayerSelection":
        """Parse the flag's text; ``ValueError`` naming ``--farskip`` when it is malformed."""
        if isinstance(text, LayerSelection):
            return text
        spec = "none" if text is None else str(text).strip()
        if spec in ("none", "all"):
            return cls(spec)
        match = re.fullmatch(r"(first|last):(\d+)", spec)
        if match:
            n = int(match.group(2))
            if n < 1:
                raise ValueError(f"--farskip {spec}: N must be >= 1")
            return cls(match.group(1), n)
        match = re.fullmatch(r"(\d+)-(\d+)", spec)
        if match:
            a, b = int(match.group(1)), int(match.group(2))
            if a > b:
                raise ValueError(f"--farskip {spec}: need A <= B")
            return cls("range", a, b)
        raise ValueError(f"--farskip {spec!r}: expected none, all, first:N, last:N or A-B")

    def __str__(self) -> str:
        if self.kind in ("none", "all"):
            return self.kind
        if self.kind == "range":
            return f"{self.a}-{self.b}"
        return f"{self.kind}:{self.a}"

    def to_config(self) -> str:
        return str(self)

    @property
    def empty(self) -> bool:
        return self.kind == "none"

    def indices(self, num_layers: int) -> frozenset[int]:
        """0-based layer indices for a model of ``num_layers``; ValueError if out of range."""
        if self.kind == "none":
            return frozenset()
        if self.kind == "all":
            return frozenset(range(num_layers))
        if self.kind in ("first", "last"):
            n = self.a
            if not 0 < n <= num_layers:
                raise ValueError(f"--farskip {self}: N must be between 1 and --num-layers {num_layers}")
            return frozenset(range(n)) if self.kind == "first" else frozenset(range(num_layers - n, num_layers))
        if not 0 <= self.a <= self.b < num_layers:
            raise ValueError(f"--farskip {self}: need 0 <= A <= B < --num-layers {num_layers}")
        return frozenset(range(self.a, self.b + 1))


@dataclasses.dataclass
class FarSkipConfig(VariantConfig):
    """FarSkip-Collective (docs/design/farskip.md)."""

    SECTION = "farskip"

    farskip: LayerSelection = LayerSelection("none")
    """layers with FarSkip connectivity: none, all, first:N, last:N or A-B (0-based, inclusive)"""
    farskip_impl: FarSkipImpl = FarSkipImpl.simple
    """simple: blocking collectives (the reference); overlapped: dispatch/combine in flight behind
    attention and the next layer"""
    farskip_mode: FarSkipMode = FarSkipMode.full
    """which sub-block reads the earlier activation"""
    farskip_connectivity: FarSkipConnectivity = FarSkipConnectivity.reference
    """reference: the authors' wiring (a standard MoE layer right before the FarSkip range hands the range
    its routed-free stream); paper-text: that layer hands on one collapsed stream (what checkpoints written
    before this option were trained with)"""
    # the deferred gradients run in moe_variants/common/wgrad.py
    farskip_defer_wgrad: bool = True
    """overlapped only: defer expert and output-layer weight gradients into the gradient all-to-alls'
    windows"""

    # inference with TP > 1: the attention output's TP reduction flies behind the MoE (paper §4.2)
    farskip_async_tp: bool = False
    """overlapped, forward only (inference), TP > 1: the attention projection's tensor-parallel reduction
    runs asynchronously behind the layer's MoE"""

    # inference: attention split at its input projections (the paper's training split, Fig. 9)
    farskip_inference_split: bool = False
    """overlapped, at inference: only attention's input projections run behind the previous layer's
    combine; core attention over the KV cache and the output projection run behind this layer's dispatch
    (default: the whole attention behind the combine)"""

    # inference: a prefill's core attention in two halves by heads, one behind each window
    farskip_inference_heads: bool = False
    """overlapped, at inference, without --farskip-async-tp: a prefill step's core attention runs for the first
    half of its heads behind the previous layer's combine and for the other half, with the output projection,
    behind this layer's dispatch (decode steps: the whole attention behind the combine)"""

    def __post_init__(self):
        self.farskip = LayerSelection.parse(self.farskip)
        coerce_enums(self)

    @classmethod
    def stored_defaults(cls, values: dict) -> dict:
        """A stored config with FarSkip layers but no ``farskip_connectivity`` was written before
        the option existed: it was trained with ``paper-text``."""
        if "farskip_connectivity" in values or LayerSelection.parse(values.get("farskip")).empty:
            return {}
        return {"farskip_connectivity": FarSkipConnectivity.paper_text.value}

    @property
    def overlapped(self) -> bool:
        return self.farskip_impl == FarSkipImpl.overlapped

    def layers(self, num_layers: int) -> frozenset[int]:
        return self.farskip.indices(num_layers)

    def lead_in_layer(self, moe_pattern: list) -> Optional[int]:
        """The standard MoE layer that hands the FarSkip range its routed-free stream (``reference``
        connectivity, a range right after an MoE layer, not ``mlp-only``), or None.
        ``moe_pattern``: 1 for an MoE layer, 0 for a dense one, per layer."""
        selected = self.layers(len(moe_pattern))
        if (self.farskip_connectivity != FarSkipConnectivity.reference or not selected
                or self.farskip_mode == FarSkipMode.mlp_only):
            return None
        before = min(selected) - 1
        return before if before >= 0 and moe_pattern[before] else None
