"""Experts over replicated activations (vLLM's serving layout, FarSkip paper §4.2):
``--expert-comm allreduce``, ``moe_variants.common.dispatcher.ReplicatedDispatcher``.

TP = EP = 2 on 2 CPU ranks, sequence parallelism off (as the server runs TP > 1):
- a standard (and a BigMac) model's logits equal the all-to-all path's to 1e-5 (fp32; the two ranks' partial
  sums are added by the all-reduce instead of in the token's own unpermute: another summation
  order), and no dispatch bytes are sent, only the all-reduce's ``2 (n-1)/n`` of ``[T, h]``;
- FarSkip's overlapped forward with every reduction asynchronous (``farskip-async-tp``: the
  experts' all-reduce in flight behind the next layer's attention, the attention's and the shared
  expert's TP reductions behind the routed experts) equals its blocking reference exactly;
- a layout whose ranks do not all hold the same tokens is refused in one line.
"""

import pytest
import torch

from tools.spawn import run_distributed
from moe_variants.config import ParallelConfig
from tests.helpers import batch, build_and_load, tiny_model_config

TP_EP = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2)


def _logits(rank, world, overrides, replicated):
    from megatron.inference.engine import replicate_activations
    from moe_variants.builder import causal_attention_mask
    from moe_variants.common import comm
    from moe_variants.common.dispatcher import use_replicated_experts
    from moe_variants.common.moe_layer import comm_counters, comm_totals

    model, pgc = build_and_load(tiny_model_config(**overrides), TP_EP)
    model.eval()
    replicate_activations(model)
    if replicated:
        assert use_replicated_experts(model, pgc) == 2
    timeline = comm.TimelineRecorder()
    for counters in comm_counters(model):
        counters.timeline = timeline
    tokens, _ = batch(0)  # the same tokens on both ranks (one tensor-parallel group)
    seq = tokens.shape[1]
    with torch.no_grad():
        logits = model(tokens, torch.arange(seq)[None].expand_as(tokens), causal_attention_mask(seq))
    names = [e[0] for e in timeline.events]
    used = [getattr(layer, "projected_inputs_used", None) for layer in model.decoder.layers]
    return logits, comm_totals(model), names, used


@pytest.mark.parametrize("overrides,width", [({}, 32), ({"moe_variant": "bigmac", "bigmac_ratio": 0.5}, 16)])
def test_standard_and_bigmac_models_equal_the_all_to_all_path(overrides, width):
    """BigMac's layer down-projects before the dispatcher and up-projects after it, so its
    all-reduce sums the experts' outputs at the latent width (here 16 of 32)."""
    a2a = run_distributed(_logits, 2, overrides, False, timeout_s=300)
    rep = run_distributed(_logits, 2, overrides, True, timeout_s=300)
    tokens = 2 * 16
    for rank in range(2):
        torch.testing.assert_close(rep[rank][0], a2a[rank][0], rtol=0, atol=1e-5)
        totals = rep[rank][1]
        assert totals["bytes_dispatch"] == 0
        # 2 layers x ring all-reduce of [T, width] fp32 over 2 ranks: 2 (n-1)/n = 1 tensor each
        assert totals["bytes_combine"] == 2 * tokens * width * 4
        assert a2a[rank][1]["bytes_dispatch"] > 0


def test_farskip_with_every_reduction_async_equals_the_blocking_reference():
    simple = run_distributed(_logits, 2, {"farskip": "all"}, True, timeout_s=300)
    overlapped = run_distributed(
        _logits, 2, {"farskip": "all", "farskip_impl": "overlapped", "farskip_async_tp": True}, True, timeout_s=300)
    for rank in range(2):
        assert torch.equal(simple[rank][0], overlapped[rank][0])
        names = overlapped[rank][2]
        # one all-reduce per MoE layer, waited by the next layer (or the final norm)
        assert names.count("combine") == 2 and names.count("wait combine") == 2
        # the attention's and the shared expert's TP reductions are waited after the routed experts
        waits = [i for i, n in enumerate(names) if n.startswith("finish attention reduction")]
        experts = [i for i, n in enumerate(names) if n.startswith("experts")]
        assert len(waits) == 2 and all(w > e for w, e in zip(waits, experts))


def test_split_attention_at_inference_equals_the_whole_attention():
    """``farskip-split-async-tp``: the QKV projection runs before the previous combine's wait, the
    rest of attention after the dispatch starts; exact, and the forward took the stored projection."""
    whole = run_distributed(
        _logits, 2, {"farskip": "all", "farskip_impl": "overlapped", "farskip_async_tp": True}, True, timeout_s=300)
    split = run_distributed(
        _logits, 2, {"farskip": "all", "farskip_impl": "overlapped", "farskip_async_tp": True,
                     "farskip_inference_split": True}, True, timeout_s=300)
    for rank in range(2):
        assert torch.equal(whole[rank][0], split[rank][0])
        assert whole[rank][3] == [None, None] and split[rank][3] == [1, 1]  # linear_qkv taken, not recomputed
        names = split[rank][2]
        qkv = [i for i, n in enumerate(names) if n.startswith("qkv")]
        attention = [i for i, n in enumerate(names) if n.startswith("attention")]
        routes = [i for i, n in enumerate(names) if n.startswith("route")]
        assert all(q < r < a for q, r, a in zip(qkv, routes, attention)) and len(qkv) == 2


def _refused(rank, world):
    from moe_variants.common.dispatcher import use_replicated_experts

    model, pgc = build_and_load(tiny_model_config(), ParallelConfig(expert_model_parallel_size=2))
    with pytest.raises(ValueError) as err:
        use_replicated_experts(model, pgc)
    return str(err.value)


def test_attention_data_parallel_layout_is_refused():
    msg = run_distributed(_refused, 2, timeout_s=300)[0]
    assert "--expert-comm allreduce needs tensor-parallel attention over exactly the expert group" in msg
    assert "\n" not in msg
