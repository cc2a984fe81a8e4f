"""The paper's qualitative findings from the default constants, table and prices.

These are model outcomes, not identities: a change to a formula, a default or a price can break
them, which is the point. The percentages themselves are reported in docs/results/netsim.md.

Speculative decoding follows the paper's model by default: drafting costs one normal decode
iteration (§3.3). With that reading and our (cheaper) network prices, switchless wins at the
relaxed TPOT only at 100 ms; the paper's "every scenario" holds in our model when drafting is fused
into verification (``DraftCost.FREE``), the labelled alternative, so both are pinned here.
"""

import dataclasses

import pytest

from netsim.serving import BASELINE, DraftCost, ServingConfig, SpecDecode
from netsim.sweep import SweepConfig, run_sweep

RELAXED = ("tpot40ms_ctx512", "tpot100ms_ctx512", "tpot40ms_ctx4096", "tpot100ms_ctx4096")
TPOT_100 = ("tpot100ms_ctx512", "tpot100ms_ctx4096")


def _sweep(draft_cost: DraftCost):
    serving = dataclasses.replace(ServingConfig(), spec=SpecDecode(draft_cost=draft_cost))
    return run_sweep(SweepConfig(variants=(BASELINE,), generations=(), serving=serving), log=lambda *a: None)


@pytest.fixture(scope="module")
def sweep():
    assert SpecDecode().draft_cost == DraftCost.DECODE_STEP  # the paper's model is the default
    return _sweep(DraftCost.DECODE_STEP)


@pytest.fixture(scope="module")
def sweep_free():
    return _sweep(DraftCost.FREE)


def test_switchless_beats_scale_up_when_the_slo_allows(sweep, sweep_free):
    """§4.3: at the 1x provision (450 GB/s, 64 XPUs) with DBO+SD, full-mesh is the better switchless
    topology and scale-out trails scale-up. Switchless beats scale-up in throughput per cost at TPOT
    100 ms with the paper's SD model, and at every relaxed TPOT (>= 40 ms) with fused drafting."""
    for result, scenarios in ((sweep, TPOT_100), (sweep_free, RELAXED)):
        topo = result["analyses"]["topology"]
        for key in RELAXED:
            row = topo[key]["dbo+sd"]
            assert row["best_switchless"] == "fullmesh3d", key
            assert row["scale-out"]["throughput_per_cost"] < row["scale-up"]["throughput_per_cost"], key
        for key in scenarios:
            assert topo[key]["dbo+sd"]["switchless_gain_over_scale_up"] > 0, key
    # when each topology may pick its best bandwidth and size (§4.4): fused drafting in every scenario
    for key, per in sweep_free["analyses"]["topology_best"].items():
        assert per["dbo+sd"]["switchless_gain_over_scale_up"] > 0, key


def test_full_mesh_on_the_pareto_frontier(sweep, sweep_free):
    """§4.4: full-mesh lies on the performance-cost Pareto frontier in every scenario; scale-out never."""
    for result in (sweep, sweep_free):
        for key, p in result["analyses"]["pareto"].items():
            assert "fullmesh3d" in p["frontier_topologies"], key
            assert "scale-out" not in p["frontier_topologies"], key


def test_scale_up_bandwidth_sweet_spot_below_450(sweep, sweep_free):
    """§4.2: with DBO+SD the most cost-effective scale-up link bandwidth is below the 450 GB/s
    provision (at TPOT 100 ms with the paper's SD model; at every relaxed TPOT with fused drafting),
    and choosing it gains throughput per cost; without DBO it does not move below 450 at 40 ms."""
    for result, scenarios in ((sweep, TPOT_100), (sweep_free, RELAXED)):
        bw = result["analyses"]["bandwidth"]
        for key in scenarios:
            e = bw[key]["dbo+sd"]
            assert e["sweet_spot_gbps"] < 450, key
            assert e["gain_over_provision"] > 0, key
        assert bw["tpot40ms_ctx512"]["noopt"]["sweet_spot_gbps"] >= 450
