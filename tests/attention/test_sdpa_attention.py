"""The SDPA core attention (``moe_variants/attention.py``) against megatron-core's ``DotProductAttention``.

For every ``--attention-backend`` that runs on torch's ``scaled_dot_product_attention`` (auto,
flash, fused, unfused: on the CPU the flash kernel and the math reference), on the same fp32
inputs: causal self-attention (no mask, the recorded causal mask), grouped-query attention, MLA's
wider query/key heads (the reference being the project's ``MLADotProductAttention``), a
per-document mask given as a tensor (the mask the data pipeline's ``reset_attention_mask`` makes),
query-key layer scaling and an explicit softmax scale; forward and the gradients of q, k and v.

Tolerance: 2e-6 relative (norm of the difference over the reference's norm), fp32. The kernels
sum the same products in another order (the flash kernel in key blocks with an online softmax, the
reference as one matmul then softmax): a few fp32 ulps per element, measured up to 3.6e-7. Dropout
cannot be compared elementwise (the masks are drawn differently); it is checked for being applied
in training and absent in evaluation.
"""

from __future__ import annotations

import pytest
import torch

from tools.spawn import run_distributed

TOLERANCE = 2e-6
SDPA_BACKENDS = ("auto", "flash", "fused", "unfused")


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm().clamp(min=1e-30))


def _modules(backend: str, *, mla: bool = False, mask_type: str = "causal", core: dict = None, **overrides):
    """(reference, SDPA attention) built for one tiny config in this (one-rank) process; ``core``
    sets megatron-core ``TransformerConfig`` fields the project's config does not carry."""
    import dataclasses

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.components.parallel import initialize_parallel
    from moe_variants.attention import sdpa_attention_class
    from moe_variants.builder import transformer_config
    from moe_variants.config import AttentionBackend, ParallelConfig
    from moe_variants.features import MLADotProductAttention
    from tests.helpers import tiny_model_config

    pgc = initialize_parallel(ParallelConfig(), seed=1)
    extra = dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=4,
                 v_head_dim=8) if mla else {}
    config = transformer_config(tiny_model_config(**extra, **overrides), ParallelConfig())
    if core:
        config = dataclasses.replace(config, **core)
    kind = AttnMaskType[mask_type]
    kwargs = dict(pg_collection=pgc)
    if mla:
        kwargs.update(k_channels=16, v_channels=8, softmax_scale=16 ** -0.5)
    reference_class = MLADotProductAttention if mla else DotProductAttention
    reference = reference_class(config, 2, kind, "self", **kwargs)
    sdpa = sdpa_attention_class(AttentionBackend(backend))(config, 2, kind, "self", **kwargs)
    return reference, sdpa


_SAME = object()


def _compare(reference, sdpa, q, k, v, mask, mask_for_sdpa=_SAME) -> dict:
    """Relative errors of ``sdpa`` against ``reference`` (``mask_for_sdpa``: what the SDPA module
    gets instead of ``mask``, e.g. None for megatron-core's implicit causal mask)."""
    outputs = []
    for module, m in ((reference, mask), (sdpa, mask if mask_for_sdpa is _SAME else mask_for_sdpa)):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = module(*leaves, m)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), leaves)
        outputs.append((out.detach(), grads))
    (ref_out, ref_grads), (out, grads) = outputs
    return {"output": _relative(out, ref_out), **{f"grad {n}": _relative(g, r)
                                                   for n, g, r in zip("qkv", grads, ref_grads)},
            "kernel": sdpa.kernel}


def _cases(rank, world, backend):
    from moe_variants.builder import causal_attention_mask

    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    seq, batch = 48, 2
    results = {}
    # causal: the recorded causal mask, and no mask at all (megatron-core's causal default)
    reference, sdpa = _modules(backend)
    q, k, v = randn(seq, batch, 4, 8), randn(seq, batch, 4, 8), randn(seq, batch, 4, 8)
    results["causal mask"] = _compare(reference, sdpa, q, k, v, causal_attention_mask(seq))
    results["causal, no mask"] = _compare(reference, sdpa, q, k, v, causal_attention_mask(seq), mask_for_sdpa=None)
    # grouped-query attention: 4 query heads over 2 key/value heads
    reference, sdpa = _modules(backend, num_query_groups=2)
    results["gqa"] = _compare(reference, sdpa, q, randn(seq, batch, 2, 8), randn(seq, batch, 2, 8),
                              causal_attention_mask(seq))
    # a per-document causal mask (two documents per sequence, split at different places per sample)
    doc_BS = torch.zeros(batch, seq, dtype=torch.long)
    doc_BS[0, 20:] = 1
    doc_BS[1, 31:] = 1
    per_doc = (doc_BS[:, :, None] != doc_BS[:, None, :]) | torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
    results["per-document mask"] = _compare(reference, sdpa, q, randn(seq, batch, 2, 8), randn(seq, batch, 2, 8),
                                            per_doc[:, None])
    # MLA: query/key heads of 16 channels, value heads of 8
    reference, sdpa = _modules(backend, mla=True)
    results["mla"] = _compare(reference, sdpa, randn(seq, batch, 4, 16), randn(seq, batch, 4, 16),
                              randn(seq, batch, 4, 8), causal_attention_mask(seq))
    # query-key layer scaling (the reference divides the scale by the layer number, multiplies back)
    reference, sdpa = _modules(backend, core=dict(apply_query_key_layer_scaling=True))
    results["query-key layer scaling"] = _compare(reference, sdpa, q, k, v, causal_attention_mask(seq))
    # a decode step (one query, no mask: every cached key visible) and a chunk of queries at the end
    # of longer keys without a mask (bottom-right causal; the reference needs the mask spelled out)
    reference, sdpa = _modules(backend)
    keys, values = randn(seq, batch, 4, 8), randn(seq, batch, 4, 8)
    results["decode"] = _compare(reference, sdpa, randn(1, batch, 4, 8), keys, values, None)
    chunk = 8
    bottom_right = torch.triu(torch.ones(chunk, seq, dtype=torch.bool), seq - chunk + 1)[None, None]
    results["chunk at the end"] = _compare(reference, sdpa, randn(chunk, batch, 4, 8), keys, values, bottom_right,
                                           mask_for_sdpa=None)
    return results


@pytest.mark.parametrize("backend", SDPA_BACKENDS)
def test_sdpa_attention_equals_dot_product_attention(backend):
    [results] = run_distributed(_cases, 1, backend, timeout_s=300)
    for case, errors in results.items():
        kernel = errors.pop("kernel")
        worst = max(errors.values())
        assert worst <= TOLERANCE, f"{backend} ({kernel} kernel), {case}: {errors}"


def _dropout(rank, world):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(32, 2, 4, 8, generator=gen) for _ in range(3))
    out = {}
    for p in (0.0, 0.5):
        _, sdpa = _modules("auto", attention_dropout=p)
        sdpa.train()
        train = sdpa(q, k, v, None)
        kernel = sdpa.kernel
        sdpa.eval()
        out[p] = (train, sdpa(q, k, v, None), kernel, sdpa.expected_kernel())
    return out


def test_dropout_applies_in_training_only():
    """Attention dropout changes the training output (under the model-parallel RNG tracker, as the
    reference) and not the evaluation output; on the CPU the flash kernel refuses dropout, so the
    math kernel runs, and the module names it."""
    [out] = run_distributed(_dropout, 1, timeout_s=300)
    plain_train, plain_eval, plain_kernel, _ = out[0.0]
    drop_train, drop_eval, drop_kernel, expected = out[0.5]
    assert torch.equal(plain_train, plain_eval) and torch.allclose(drop_eval, plain_eval, rtol=0, atol=1e-6)
    assert not torch.allclose(drop_train, plain_train) and torch.isfinite(drop_train).all()
    assert (plain_kernel, drop_kernel, expected) == ("flash", "math", "math")
