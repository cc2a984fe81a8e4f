"""A checkpoint written before the variant registry (commit 1396b24: the variants' fields inside the
``model`` section of the manifest) still loads and computes the same logits.

The fixture (``tests/fixtures/ckpt_v1_bigmac_farskip``: BigMac r=0.5 + FarSkip last:1 overlapped, 2
layers, weights only) and its ``reference_logits.npy`` were written by that commit's code with
``make_fixture.py`` (README beside it). It predates ``--farskip-connectivity``, so it loads with the
wiring it was trained with, ``paper-text``: asserted directly, because under today's default
``reference`` (its MoE layer 0 handing layer 1 its routed-free stream) the logits move by only
7e-7, inside the tolerance (two training steps from a 0.02 initialisation leave the routed
experts' outputs small). Tolerance 1e-5: the same float32 ops, but the fixture was
made with 2 threads and this test runs with 1, which may change GEMM blocking in the last bits.
"""

import os

import numpy as np
import torch

from tools.spawn import run_distributed

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "ckpt_v1_bigmac_farskip")


def _logits(rank, world):
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants import registry
    from moe_variants.builder import causal_attention_mask
    from moe_variants.config import ParallelConfig

    pgc = initialize_parallel(ParallelConfig(), seed=1)
    model, configs, _, _ = load_model(FIXTURE, parallel=ParallelConfig(), pg_collection=pgc)
    tokens = torch.arange(1, 17).remainder(2000)[None]
    with torch.no_grad():
        logits = model(tokens, torch.arange(16)[None], causal_attention_mask(16))
    farskip = configs.model.variants["farskip"]
    return (logits.numpy(), [v.name for v in registry.enabled(configs.model)], str(farskip.farskip),
            farskip.farskip_connectivity.value)


def test_pre_registry_checkpoint_loads_with_the_same_logits():
    logits, enabled, farskip, connectivity = run_distributed(_logits, 1)[0]
    assert enabled == ["bigmac", "farskip"] and farskip == "last:1" and connectivity == "paper-text"
    reference = np.load(os.path.join(FIXTURE, "reference_logits.npy"))
    np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5)
