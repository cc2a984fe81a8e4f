"""Benchmark peers: other stacks' expert-parallel MoE, run by the EP benchmark beside our variants.

A peer is a bench variant that is not one of our variants (``moe_variants.registry``) but what a
user would otherwise run: the same GPT, the same data, seed, link and training step, with the MoE
layer (or the schedule) of another stack. Peers are runtime variants of the model worker
(``tools.bench.variant_worker``); each one says what it needs before anything is launched
(``refusal``), so a missing package, GPU or Transformer Engine is a one-line error from
``bench_ep.py``, not a crash in a rank.

* ``deepspeed-moe``: every MoE layer's routed part is ``deepspeed.moe.layer.MoE`` (GShard-style
  capacity dispatch) with our weights copied in (:mod:`.deepspeed_moe`); CPU and gloo.
* ``mcore-latent``: megatron-core 0.16.1's own latent MoE (``moe_latent_size``) with its
  Transformer Engine spec, upstream router and dispatcher: the BigMac peer; GPU only (:mod:`.mcore`).
* ``mcore-ep-overlap``: megatron-core's own EP all-to-all overlap (``overlap_moe_expert_parallel_comm``
  + ``delay_wgrad_compute``, the combined 1F1B schedule): the FarSkip peer; GPU only.

This module is light (no torch, no deepspeed import): the CLI validates ``--variants`` with it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Callable, Optional

__all__ = ["Peer", "PEERS", "get", "names", "refusal"]


@dataclasses.dataclass(frozen=True)
class Peer:
    """One peer: its name, the module that implements it, and what it needs.

    ``module`` provides ``refusal(device, ranks) -> str | None`` (checked by the CLI before any
    launch and again by the worker) and ``WorkerHooks(configs, pg_collection, options)`` (the
    worker's hooks: config changes, model build arguments, ``before_wrap``, forward step).
    ``device`` is the bench's ``--device`` (``cpu`` or ``cuda``).
    """

    name: str
    module: str
    summary: str
    device: str  # the --device it runs on
    measures_a2a_time: bool  # False: only bytes are counted (it cannot be the rate search's probe)

    def load(self):
        return importlib.import_module(self.module)


PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer("deepspeed-moe", "tools.bench.peers.deepspeed_moe",
             "DeepSpeed-MoE layer (deepspeed.moe.layer.MoE) in place of each MoE layer's routed part", "cpu", True),
        Peer("mcore-latent", "tools.bench.peers.mcore",
             "megatron-core's own latent MoE (moe_latent_size, Transformer Engine spec)", "cuda",
             False),
        Peer("mcore-ep-overlap", "tools.bench.peers.mcore",
             "megatron-core's own EP all-to-all overlap (combined 1F1B + delayed wgrad)",
             "cuda", False),
    )
}  # fmt: skip


def names() -> tuple[str, ...]:
    return tuple(PEERS)


def get(variant: str) -> Optional[Peer]:
    """The peer a bench variant name names, or None (``+`` combinations are never peers)."""
    return PEERS.get(variant)


def refusal(variant: str, device: str, ranks: int) -> Optional[str]:
    """Why ``variant`` cannot run here, in one line naming what is missing, or None.

    A peer cannot be combined with other variants (``deepspeed-moe+bigmac``): it replaces the
    layer the variants change.
    """
    parts = variant.split("+")
    peers_named = [p for p in parts if p in PEERS]
    if not peers_named:
        return None
    if len(parts) > 1:
        return f"--variants {variant}: the peer {peers_named[0]} runs alone (it cannot be combined with '+')"
    peer = PEERS[variant]
    check: Callable = getattr(peer.load(), "refusal")
    return check(variant, device, ranks)


def have_module(name: str) -> bool:
    """Whether ``name`` is importable (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
