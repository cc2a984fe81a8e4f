"""Model FLOPs per token (MFU in the step line): the active weights counted from a built model
equal a hand count from its shapes, at EP=1 and EP=2 (exact: integer counts)."""

import pytest

from megatron.training.flops import active_weights, flops_per_token
from tools.spawn import run_distributed
from moe_variants.config import ParallelConfig
from tests.helpers import build_and_load, tiny_model_config


def hand_count(h=32, e_ffn=48, shared=32, experts=4, topk=2, layers=2, vocab=128, swiglu=True):
    """Weights one token multiplies by: QKV + output projection, the router, top-k experts and the
    shared expert per layer (SwiGLU: fc1 is two matrices), and the output layer (the vocabulary
    padded to 128); no embedding lookup, no norms or biases."""
    up = 2 if swiglu else 1
    attention = 3 * h * h + h * h
    expert = h * e_ffn * up + e_ffn * h
    shared_expert = h * shared * up + shared * h
    per_layer = attention + experts * h + topk * expert + shared_expert
    return layers * per_layer + vocab * h


def _count(rank, world):
    ep = world
    cfg = tiny_model_config()
    model, _ = build_and_load(cfg, ParallelConfig(expert_model_parallel_size=ep))
    n = active_weights(model, num_experts=4, topk=2, num_local_experts=4 // ep)
    return n, flops_per_token(model.config, n, seq_length=16)


@pytest.mark.parametrize("world", [1, 2])
def test_active_weights_match_a_hand_count(world):
    results = run_distributed(_count, world_size=world)
    expected = hand_count()
    for n, flops in results:
        assert n == expected
        # PaLM: 6N + 6 L s H (d_qk + d_v) with 4 heads of 8 dims, s = 16, L = 2
        assert flops == 6 * expected + 6 * 2 * 16 * 4 * (8 + 8)
