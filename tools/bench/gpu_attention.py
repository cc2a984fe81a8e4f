"""Core attention alone, for ``python -m tools.bench.gpu``'s ``attention`` section.

One core-attention module of the training model (``moe_variants/attention.py``: SDPA under each
``--attention-backend``; ``local``: megatron-core's ``DotProductAttention``) on random causal
inputs of a real shape, forward and forward+backward, timed like the other sections
(``gpu_measure.timed``). FLOPs are counted as FlashAttention's benchmarks count them: a causal
forward does ``2 b h s^2 (d_qk + d_v) / 2`` (the masked half skipped), the backward 2.5 times the
forward, so forward+backward is 3.5 times it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["AttentionShape", "measure_attention"]


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """A causal self-attention call: ``batch`` sequences of ``seq`` tokens, ``heads`` query heads
    over ``kv_heads`` key/value heads of ``qk_dim`` (queries, keys) and ``v_dim`` (values)."""

    name: str
    batch: int
    seq: int
    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int

    def flops_forward(self) -> float:
        return 2.0 * self.batch * self.heads * self.seq ** 2 * (self.qk_dim + self.v_dim) / 2


def _module(shape: AttentionShape, backend: str, bf16: bool, pg_collection):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from moe_variants.attention import sdpa_attention_class
    from moe_variants.builder import transformer_config
    from moe_variants.config import AttentionBackend, ModelConfig, ParallelConfig
    from moe_variants.features import MLADotProductAttention

    model = ModelConfig(num_layers=1, hidden_size=shape.heads * shape.v_dim, num_attention_heads=shape.heads,
                        num_query_groups=shape.kv_heads, kv_channels=shape.qk_dim, seq_length=shape.seq,
                        bf16=bf16, transformer_impl="local", num_experts=None)
    config = transformer_config(model, ParallelConfig())
    kwargs = dict(pg_collection=pg_collection)
    if shape.v_dim != shape.qk_dim:
        kwargs.update(k_channels=shape.qk_dim, v_channels=shape.v_dim)
    if backend == "local":
        cls = MLADotProductAttention if shape.v_dim != shape.qk_dim else DotProductAttention
    else:
        cls = sdpa_attention_class(AttentionBackend(backend))
    return cls(config, 1, AttnMaskType.causal, "self", **kwargs)


def measure_attention(shape: AttentionShape, backends, *, bf16: bool, warmup: int, iters: int, pg_collection,
                      peak_tflops: Optional[float]) -> dict:
    """Forward and forward+backward of ``shape`` under each of ``backends``; the outputs of every
    backend checked against the first one's (relative error of the output)."""
    from moe_variants.builder import causal_attention_mask
    from tools.bench.gpu_measure import device, peak_memory_gb, reset_peak_memory, timed

    dev = device()
    dtype = torch.bfloat16 if bf16 else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=gen, device=dev).to(dtype).requires_grad_(True)

    q = randn(shape.seq, shape.batch, shape.heads, shape.qk_dim)
    k = randn(shape.seq, shape.batch, shape.kv_heads, shape.qk_dim)
    v = randn(shape.seq, shape.batch, shape.kv_heads, shape.v_dim)
    mask = causal_attention_mask(shape.seq, device=dev)
    dy = torch.randn(shape.seq, shape.batch, shape.heads * shape.v_dim, generator=gen, device=dev).to(dtype)
    flops = shape.flops_forward()
    results, reference = {}, None
    for backend in backends:
        reset_peak_memory()
        module = _module(shape, backend, bf16, pg_collection)

        def forward():
            with torch.no_grad():
                return module(q, k, v, mask)

        def forward_backward():
            for t in (q, k, v):
                t.grad = None
            module(q, k, v, mask).backward(dy)

        out = forward().float()
        reference = out if reference is None else reference
        fwd = timed(forward, warmup=warmup, iters=iters)
        both = timed(forward_backward, warmup=warmup, iters=iters)
        result = {"forward": fwd, "forward_backward": both,
                  "tflops_forward": flops / fwd["median_s"] / 1e12,
                  "tflops_forward_backward": 3.5 * flops / both["median_s"] / 1e12,
                  "kernel": getattr(module, "kernel", None) or "bmm + softmax + bmm",
                  "relative_error_vs_first": float((out - reference).norm() / reference.norm()),
                  "peak_memory_gb": peak_memory_gb()}
        if peak_tflops:
            result["percent_of_peak_forward"] = 100 * result["tflops_forward"] / peak_tflops
            result["percent_of_peak_forward_backward"] = 100 * result["tflops_forward_backward"] / peak_tflops
        results[backend] = result
        del module
    return {"shape": dataclasses.asdict(shape), "dtype": str(dtype), "flops_forward": flops,
            "flops_note": "causal: 2 b h s^2 (d_qk + d_v) / 2 forward, 3.5x that forward+backward (FlashAttention's count)",
            "backends": results}
