"""Core attention of a prefill step in two halves by heads, the second half and the output
projection run later (FarSkip's inference schedule with ``--farskip-inference-heads``).

megatron-core's ``Attention.forward`` and ``MultiLatentAttention.forward`` (0.16.1) run a dynamic-
engine step as: input projections, cache write, ``self.flash_decode_and_prefill(...)`` over the
paged cache (``attention.py:1166``, ``multi_latent_attention.py:309``), a view to [T, 1, H*Dv],
``self.linear_proj(...)`` and ``return output, bias`` (``attention.py:1208-1215``,
``multi_latent_attention.py:153-159``). Within ``HeadSplit.early()`` a prefill step's call computes
only the first half of the heads (into a buffer of the full output's shape) and the output
projection is deferred: the forward returns ``(None, None)``. ``finish()`` then computes the other
heads into the same buffer and runs the output projection on the view upstream passed it:
``(output, bias)``, the values the undivided forward returns.

Heads attend independently, so each half is the kernel's own call on a slice of the query heads and
of the key/value heads they read (grouped-query attention: query head ``h`` reads key head
``h // (Hq / Hk)``, so the first ``Hk / 2`` key heads serve the first ``Hq / 2`` query heads; with one
key head both halves read it). The halves cost half the undivided call each, whatever the requests'
lengths (a split by query rows would pad every request to the longest in both calls), and come out
equal to it bit for bit with both plain-torch kernels (tests/farskip/test_split_attention.py).

Decode-only steps (one query per request; FlashMLA's absorbed path on MLA) run undivided, as do
attentions with one query head or an odd number of key heads above one. An output gate or FP8
between the kernel and the projection would copy the buffer before its second half is written:
``early()`` refuses such an attention, and the deferred projection checks that its input is a view
of the buffer.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["HeadSplit", "head_halves"]


def head_halves(query_heads: int, key_heads: int):
    """``[(query slice, key slice), (query slice, key slice)]`` of the two halves, or None where the
    heads do not divide (one query head; an odd number of key heads above one)."""
    if query_heads < 2 or query_heads % 2 or (key_heads > 1 and key_heads % 2):
        return None
    if key_heads == 1:
        return [(slice(0, query_heads // 2), slice(0, 1)), (slice(query_heads // 2, query_heads), slice(0, 1))]
    return [(slice(0, query_heads // 2), slice(0, key_heads // 2)),
            (slice(query_heads // 2, query_heads), slice(key_heads // 2, key_heads))]


class HeadSplit:
    """One attention module's prefill forward in two halves by heads (module docstring)."""

    def __init__(self, attn):
        self.attn = attn
        self.pending = None  # (second half's call, buffer) while it waits
        self.projection_input = None

    @staticmethod
    def supported(attn) -> bool:
        """Whether ``attn``'s forward passes the kernel's output to its projection by views only."""
        cfg = attn.config
        return not (getattr(cfg, "attention_output_gate", False) or getattr(cfg, "fp8", None)
                    or getattr(cfg, "fp4", None))

    @contextlib.contextmanager
    def early(self):
        """Within the block, a prefill forward of ``attn`` computes its first heads and defers the rest."""
        attn = self.attn
        if not self.supported(attn):
            raise ValueError(f"split core attention: {type(attn).__name__} changes the kernel's output before "
                             "its projection (an output gate or FP8), so it cannot be computed in parts")
        kernel = type(attn).flash_decode_and_prefill
        projection = attn.linear_proj
        self.pending, self.projection_input = None, None

        def flash_decode_and_prefill(q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k,
                                     seqlens_k, block_table, *rest):
            decode_only = rest[0] if rest and rest[0] is not None else getattr(attn, "_mla_decode_only", False)
            halves = None if v is None else head_halves(q.shape[-2], k.shape[-2])
            if decode_only or self.pending is not None or halves is None:
                return kernel(attn, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k,
                              seqlens_k, block_table, *rest)

            def call(heads, key_heads):
                return kernel(attn, q[..., heads, :], k[..., key_heads, :], v[..., key_heads, :], max_seqlen_q,
                              max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k, block_table, *rest)

            first = call(*halves[0])
            buffer = first.new_empty(tuple(first.shape[:-2]) + (q.shape[-2], first.shape[-1]))
            buffer[..., halves[0][0], :] = first
            self.pending = (lambda: call(*halves[1]), halves[1][0], buffer)
            return buffer

        def deferred_projection(hidden, *args, **kwargs):
            if self.pending is None or self.projection_input is not None:
                return projection.__class__.forward(projection, hidden, *args, **kwargs)
            buffer = self.pending[2]
            if hidden.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
                raise RuntimeError("split core attention: the output projection's input is not a view of the "
                                   "kernel's output (megatron-core changed its attention forward)")
            self.projection_input = (hidden, args, kwargs)
            return None, None

        attn.flash_decode_and_prefill = flash_decode_and_prefill
        projection.forward = deferred_projection
        try:
            yield self
        finally:
            del attn.flash_decode_and_prefill
            del projection.forward

    @property
    def deferred(self) -> bool:
        """Whether the last ``early()`` forward left heads and the projection for ``finish()``."""
        return self.pending is not None and self.projection_input is not None

    def finish(self):
        """The other heads, then the output projection: ``(output, bias)`` of the whole forward."""
        if not self.deferred:
            raise RuntimeError("split core attention: nothing deferred (a decode step, or finish() called twice)")
        (call, heads, buffer), (hidden, args, kwargs) = self.pending, self.projection_input
        buffer[..., heads, :] = call()
        self.pending = self.projection_input = None
        projection = self.attn.linear_proj
        return projection(hidden, *args, **kwargs)
