"""The ``deepspeed-moe`` bench peer: DeepSpeed's MoE layer with our weights computes our layer's function.

Routing where both agree: top-2, softmax, ``top2_2nd_expert_sampling=False`` and no token dropping
(``drop_tokens=False``) make DeepSpeed's gate the top-2 of the softmax renormalised over the two
choices, which is what megatron-core's router computes (top-2 logits, softmax over them). With our
router and expert weights copied in, the output and the gradients (input, gate, experts) must then
agree at EP=2 to fp32 rounding: ``rtol 1e-5``, ``atol 1e-6`` of each tensor's largest magnitude (the
two layers apply the gate weight at different points and sum the two routes in different orders;
the observed differences are ~1e-7 relative). The auxiliary losses differ by design (DeepSpeed's
GShard form counts the first choice only), so the coefficient is 0 for the comparison.

Volume: DeepSpeed sends every expert's buffer padded to the capacity C (dropless: the largest
per-expert count on any EP rank; with a capacity factor: ceil(cf x T x K / E)), so its off-rank
dispatch bytes per rank are ``(E - E/D) x C x H x 4`` exactly, and never fewer than ours, which are
the routed rows only.
"""

import os

import pytest
import torch

from tools.spawn import run_distributed
from moe_variants.config import ParallelConfig
from tests.helpers import tiny_model_config

pytest.importorskip("deepspeed")


def _assert_close_scaled(got, ref, name=""):
    scale = float(ref.abs().max()) or 1.0
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{name}: {m}")


def _both_layers(rank, world, topk, shared=None):
    from moe_variants.common.comm import CommCounters
    from moe_variants.common.experts import local_expert_weights
    from moe_variants.common.moe_layer import comm_counters, moe_layers
    from tests.helpers import build_and_load
    from tools.bench.peers import deepspeed_moe

    cfg = tiny_model_config(num_layers=1, moe_aux_loss_coeff=0.0, moe_router_topk=topk,
                            moe_shared_expert_intermediate_size=shared)  # fmt: skip
    model, pgc = build_and_load(cfg, ParallelConfig(expert_model_parallel_size=2))
    ours = moe_layers(model)[0]
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(24, 2, cfg.hidden_size, generator=gen)
    routing = {}
    ours.router.routing_observer = lambda n, rmap, probs: routing.__setitem__("map", rmap.clone())
    results = []
    xi = x.clone().requires_grad_(True)
    out, _ = ours(xi)
    out.square().sum().backward()
    local = [(fc1.clone(), fc2.clone()) for fc1, fc2 in local_expert_weights(ours.experts, grad=True)]
    results.append((out.detach(), xi.grad, ours.router.weight.grad.clone(), local,
                    CommCounters.total(comm_counters([model]))))  # fmt: skip
    ours_bytes = results[0][4]["bytes_dispatch"]
    layers = deepspeed_moe.replace_moe_layers(model, cfg, pgc)
    assert moe_layers(model) == [] and len(layers) == 1
    ds = layers[0]
    counters = comm_counters([model])
    assert counters == [ds.moe_comm_counters]
    xi = x.clone().requires_grad_(True)
    out, bias = ds(xi)
    assert bias is None
    out.square().sum().backward()
    experts = ds.moe.deepspeed_moe.experts.deepspeed_experts
    local = [(e.fc1.weight.grad.clone(), e.fc2.weight.grad.clone()) for e in experts]
    results.append((out.detach(), xi.grad, ds.moe.deepspeed_moe.gate.wg.weight.grad.clone(), local,
                    CommCounters.total(counters)))  # fmt: skip
    # capacity DeepSpeed used: the largest per-expert count of routed tokens over both ranks
    counts = routing["map"].sum(0)
    torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX)
    return results, int(counts.max()), ours_bytes, (ds.routed_rows, ds.buffer_rows), cfg.hidden_size, cfg.num_experts


@pytest.mark.slow  # processes that import deepspeed (about 70 s the first time)
@pytest.mark.parametrize("topk, shared", [(2, None), (3, None), (2, 32)])
def test_deepspeed_layer_computes_our_function_at_ep2(topk, shared):
    """top-2 (DeepSpeed's top2gating) and top-3 (its general topkgating), and top-2 with our shared
    expert kept beside DeepSpeed's routed experts: same output and gradients."""
    for results, capacity, ours_bytes, (routed, buffer), hidden, experts in run_distributed(_both_layers, 2, topk, shared):
        (o, gx, gw, local, comm_o), (d, gxd, gwd, local_d, comm_d) = results
        _assert_close_scaled(d, o, "output")
        _assert_close_scaled(gxd, gx, "input grad")
        _assert_close_scaled(gwd, gw, "gate/router weight grad")
        for i, ((f1, f2), (f1d, f2d)) in enumerate(zip(local, local_d)):
            _assert_close_scaled(f1d, f1, f"expert {i} fc1 grad")
            _assert_close_scaled(f2d, f2, f"expert {i} fc2 grad")
        padded = (experts - experts // 2) * capacity * hidden * 4
        assert comm_d["bytes_dispatch"] == padded
        assert comm_d["bytes_combine"] == padded
        assert comm_d["bytes_backward"] == 2 * padded
        assert comm_d["bytes_meta"] == 0
        assert comm_d["time_fwd_s"] > 0 and comm_d["time_bwd_s"] > 0
        assert comm_d["bytes_dispatch"] >= ours_bytes > 0
        assert routed == 48 * topk and buffer == experts * capacity >= routed


def _capacity_layers(rank, world, topk, cf):
    import math

    from moe_variants.common.comm import CommCounters
    from moe_variants.common.moe_layer import moe_layers
    from moe_variants.common.routing import DropCounter
    from tests.helpers import build_and_load
    from tools.bench.peers import deepspeed_moe

    cfg = tiny_model_config(num_layers=1, moe_aux_loss_coeff=0.0, moe_router_topk=topk, moe_expert_capacity_factor=cf)
    model, pgc = build_and_load(cfg, ParallelConfig(expert_model_parallel_size=2))
    ours = moe_layers(model)[0]
    x = torch.randn(24, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(200 + rank))
    tokens = x.numel() // cfg.hidden_size
    # the dropless choice, from the router's weight: every expert keeps min(its count, C) pairs
    chosen = torch.topk(x.view(tokens, -1) @ ours.router.weight.t(), topk, dim=1).indices
    counts = torch.bincount(chosen.view(-1), minlength=cfg.num_experts)
    capacity = math.ceil(tokens * topk / cfg.num_experts * cf)
    expected = int(counts.clamp(max=capacity).sum())
    with DropCounter(model) as drops:
        ours(x)
    got_ours = drops.take()
    ds = deepspeed_moe.replace_moe_layers(model, cfg, pgc)[0]
    out, _ = ds(x)
    comm = CommCounters.total([ds.moe_comm_counters])
    return (expected, tokens * topk, got_ours, deepspeed_moe.padding_stats([model]), capacity, cfg.num_experts,
            cfg.hidden_size, comm["bytes_dispatch"], bool(torch.isfinite(out).all()))


@pytest.mark.slow  # DeepSpeed's comm: its op is JIT-built on first use in an environment (about a minute)
@pytest.mark.parametrize("topk", [2, 3])
def test_capacity_mode_keeps_the_same_pairs_count_in_both_stacks(topk):
    """``--moe-expert-capacity-factor 0.5``: DeepSpeed runs ``drop_tokens=True`` at the same capacity
    C = ceil(cf x T x K / E) as megatron-core. Whatever the policy (DeepSpeed's top-2 gate keeps first
    choices first, megatron-core and DeepSpeed's top-k gate keep the most probable), every expert
    keeps min(its routed count, C) pairs, so both stacks keep exactly that many, fewer than routed;
    DeepSpeed still sends every expert's full C-row buffer."""
    for expected, routed, ours, ds, capacity, experts, hidden, sent, finite in run_distributed(
            _capacity_layers, 2, topk, 0.5):
        assert expected < routed  # cf 0.5 must drop something, else the test shows nothing
        assert ours == {"routed_rows": routed, "kept_rows": expected}
        assert ds == {"routed_rows": routed, "kept_rows": expected, "buffer_rows": experts * capacity}
        assert sent == (experts - experts // 2) * capacity * hidden * 4
        assert finite


def _refusals(rank, world):
    from tools.bench.peers import deepspeed_moe

    out = []
    for overrides in (dict(moe_router_score_function="sigmoid"), dict(moe_router_topk=1), dict(moe_variant="bigmac"),
                      dict(farskip="all")):
        out.append(deepspeed_moe.model_refusal(tiny_model_config(**overrides), ParallelConfig()))
    out.append(deepspeed_moe.model_refusal(tiny_model_config(), ParallelConfig()))
    out.append(deepspeed_moe.model_refusal(tiny_model_config(moe_router_topk=1, moe_router_pre_softmax=True),
                                           ParallelConfig()))
    out.append(deepspeed_moe.model_refusal(tiny_model_config(moe_expert_capacity_factor=1.0), ParallelConfig()))
    return out


def test_configurations_deepspeed_cannot_match_are_refused_naming_the_flag():
    *bad, ok, ok_top1, ok_capacity = _refusals(0, 1)
    assert "--moe-router-score-function" in bad[0]
    assert "--moe-router-pre-softmax" in bad[1]
    assert "bigmac" in bad[2] and "farskip" in bad[3]
    assert ok is None and ok_top1 is None and ok_capacity is None  # a capacity factor is DeepSpeed's drop mode


def test_deepspeed_still_sends_through_the_all_to_all_the_peer_counts():
    """The peer counts by replacing ``sharded_moe._AllToAll``: DeepSpeed's MOELayer must still call
    it for dispatch and combine (an upgrade that stops would be caught at run time too)."""
    import inspect

    from deepspeed.moe import sharded_moe

    source = inspect.getsource(sharded_moe.MOELayer.forward)
    assert source.count("_AllToAll.apply(self.ep_group,") == 2


@pytest.mark.slow
def test_bench_runs_deepspeed_moe_beside_standard_and_reports_its_padding(tmp_path):
    """End to end over loopback: ``bench_ep.py --variants standard,deepspeed-moe`` writes both rows.
    The two models start from the same weights and route identically, so the first step's LM loss
    agrees to fp32 rounding (rtol 1e-4: only the summation order differs; the auxiliary losses
    differ in form but not the LM loss of a forward); DeepSpeed's padded buffers make its bytes no
    fewer than ours, and the padding it reports is what its byte counts imply."""
    import json
    import os
    import subprocess
    import sys

    from tools import repo_root
    from tools.bench.schema import STEP_FIELDS

    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(repo_root(), "scripts", "bench_ep.py"), "--no-netns",
         "--variants", "standard,deepspeed-moe", "--runs", "1", "--warmup", "0", "--steps", "2", "--num-layers", "2",
         "--hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--json", str(out), "--timeout-s", "400"],
        capture_output=True, text=True, timeout=450,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deepspeed-moe: dispatch buffers padded to capacity" in proc.stdout
    data = json.loads(out.read_text())
    std, ds = data["variants"]["standard"], data["variants"]["deepspeed-moe"]
    for key in (*STEP_FIELDS, "a2a_bytes", "comm_fraction", "tokens_per_s", "dispatch_rows"):
        assert key in ds, key
    assert ds["a2a_time_s"]["median"] > 0 and ds["a2a_bytes"]["min"] >= std["a2a_bytes"]["min"] > 0
    assert data["ratios"]["deepspeed-moe"]["bytes_ratio"] >= 1.0
    rows = ds["dispatch_rows"]
    assert rows["buffer"] >= rows["routed"] > 0
    # dropless in both stacks: every routed (token, expert) pair kept
    assert rows["dropped_fraction"] == 0.0 and std["dispatch_rows"]["dropped_fraction"] == 0.0
    assert std["dispatch_rows"]["routed"] == rows["routed"]
    hidden, layers = 32, 2
    for r_std, r_ds in zip(data["per_rank"]["standard"][0], data["per_rank"]["deepspeed-moe"][0]):
        assert r_ds["extra"]["lm_loss"][0] == pytest.approx(r_std["extra"]["lm_loss"][0], rel=1e-4)
        assert r_ds["extra"]["peer"] == {"peer": "deepspeed-moe"}
        # 2 ranks: half of each rank's padded buffer (all experts x capacity) leaves it, 4 bytes a value
        for sent, buffer_rows in zip(r_ds["a2a_bytes_dispatch"], r_ds["extra"]["buffer_rows"]):
            assert sent == buffer_rows // 2 * hidden * 4
    assert layers == data["config"]["overrides"]["num_layers"]


def test_deepspeed_builds_its_ops_with_the_environments_ninja(tmp_path, monkeypatch):
    """The environment's ninja goes first on PATH (once), so that processes started with and without
    the environment's bin on PATH use one ninja and do not rebuild DeepSpeed's op in turn."""
    from tools.bench.peers.deepspeed_moe import use_the_environments_ninja

    bindir = tmp_path / "env" / "bin"
    bindir.mkdir(parents=True)
    monkeypatch.setattr("sys.executable", str(bindir / "python"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    use_the_environments_ninja()
    assert os.environ["PATH"] == "/usr/bin:/bin"  # no ninja in the environment: PATH as it was
    (bindir / "ninja").write_text("")
    use_the_environments_ninja()
    use_the_environments_ninja()
    assert os.environ["PATH"] == f"{bindir}:/usr/bin:/bin"
