"""Compute tables: the shipped default is the labelled roofline estimate it claims to be, lookups
interpolate linearly, the Table 5 projection scales compute- and memory-bound points by the right
factor, and files round-trip or fail with one-line errors."""

import json

import numpy as np
import pytest

from netsim.compute import (
    DEFAULT_TABLE_PATH,
    GENERATION_SCALING,
    H100_SXM,
    RooflineEfficiency,
    default_table,
    generation_spec,
    load_table,
    project_table,
    roofline_table,
)
from netsim.model import DEEPSEEK_V3, LayerKind, kernel_work


def test_shipped_table_is_the_labelled_roofline_estimate():
    """Guards against a stale or hand-edited default: regenerating gives the same numbers (6 digits)."""
    shipped = default_table()
    assert shipped.provenance["method"] == "roofline-estimate"
    assert "NOT MEASURED" in shipped.provenance["note"] and shipped.provenance["gpu"] == H100_SXM.name
    fresh = roofline_table()
    assert set(shipped.kinds) == set(LayerKind)
    for k, kt in fresh.kinds.items():
        np.testing.assert_allclose(shipped.kinds[k].seconds, kt.seconds, rtol=1e-5)


def test_kernel_work_by_hand():
    f, b, n, _ = kernel_work(LayerKind.MLA_PROJ, DEEPSEEK_V3, tokens=1.0, tp=1.0)
    repl, shard = DEEPSEEK_V3.attention_params()
    assert float(f) == 2 * (repl + shard) and n == 6
    assert float(b) > repl + shard  # FP8 weights plus activations
    f, b, _, _ = kernel_work(LayerKind.MLA_CORE, DEEPSEEK_V3, requests=2.0, ctx=1000.0, q_len=1.0, tp=4.0)
    assert float(f) == 2 * 2 * 1000 * 32 * (576 + 512)
    assert float(b) == 2 * 1000 * 576 * 2 + 2 * 32 * (576 + 512) * 2
    # one token over 256 experts touches one expert; many tokens touch all of them
    _, b1, _, _ = kernel_work(LayerKind.MOE_EXPERTS, DEEPSEEK_V3, routed_tokens=1.0, experts=256.0)
    _, bn, _, _ = kernel_work(LayerKind.MOE_EXPERTS, DEEPSEEK_V3, routed_tokens=1e5, experts=256.0)
    w = DEEPSEEK_V3.expert_params()
    assert w < float(b1) < 1.01 * w and float(bn) > 256 * w


def test_lookup_interpolates():
    t = default_table()
    kt = t.kinds[LayerKind.MLA_PROJ]
    g_tok = kt.grid[0]
    # exact at grid points
    np.testing.assert_allclose(t.seconds("mla_proj", tokens=g_tok, tp=2.0), kt.seconds[:, 1], rtol=1e-12)
    # linear between them and below the grid clamps to the first point
    mid = 0.5 * (g_tok[10] + g_tok[11])
    assert float(t.seconds("mla_proj", tokens=mid, tp=2.0)) == pytest.approx(0.5 * (kt.seconds[10, 1] + kt.seconds[11, 1]))
    assert float(t.seconds("mla_proj", tokens=0.25, tp=2.0)) == pytest.approx(kt.seconds[0, 1])
    # broadcasting
    out = t.seconds("mla_core", requests=np.array([[1.0], [8.0]]), ctx=np.array([512.0, 4096.0]), q_len=1.0, tp=1.0)
    assert out.shape == (2, 2) and out[1, 1] > out[0, 0]
    with pytest.raises(ValueError, match="outside the table"):
        t.seconds("mla_proj", tokens=1.0, tp=16.0)
    with pytest.raises(ValueError, match="expected axes"):
        t.seconds("mla_proj", tokens=1.0)


def test_table5_projection():
    """With no per-kernel overhead, a compute-bound point speeds up by the FLOP/s factor and a
    memory-bound one by the bandwidth factor (Blackwell: 2.56 and 2.39)."""
    eff = RooflineEfficiency(kernel_overhead_s=0.0)
    h100 = roofline_table(eff=eff)
    bw = generation_spec("blackwell")
    proj = project_table(h100, bw, eff=eff)
    direct = roofline_table(gpu=bw, eff=eff)
    for k in LayerKind:
        np.testing.assert_allclose(proj.kinds[k].seconds, direct.kinds[k].seconds, rtol=1e-9)
    s = GENERATION_SCALING["blackwell"]
    big = float(h100.seconds("moe_experts", routed_tokens=2.0**19, experts=1.0))  # compute-bound
    one = float(h100.seconds("moe_experts", routed_tokens=1.0, experts=32.0))  # weight-bound
    assert big / float(proj.seconds("moe_experts", routed_tokens=2.0**19, experts=1.0)) == pytest.approx(s["flops"], rel=1e-6)
    assert one / float(proj.seconds("moe_experts", routed_tokens=1.0, experts=32.0)) == pytest.approx(s["mem_bandwidth"], rel=1e-6)
    assert bw.mem_capacity == pytest.approx(80e9 * 2.33) and bw.link_bandwidth == pytest.approx(900e9)
    with pytest.raises(ValueError, match="unknown GPU generation"):
        generation_spec("volta")


def test_roundtrip_and_bad_files(tmp_path):
    t = roofline_table()
    t.save(tmp_path / "t.json")
    u = load_table(tmp_path / "t.json")
    assert u.provenance == t.provenance and u.model == t.model
    np.testing.assert_allclose(u.kinds[LayerKind.LM_HEAD].seconds, t.kinds[LayerKind.LM_HEAD].seconds, rtol=1e-5)
    with pytest.raises(ValueError, match="no such compute table"):
        load_table(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON compute table"):
        load_table(tmp_path / "bad.json")
    d = json.loads(DEFAULT_TABLE_PATH.read_text())
    d["kinds"]["mla_proj"]["seconds"] = d["kinds"]["mla_proj"]["seconds"][:-1]
    (tmp_path / "short.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="malformed compute table"):
        load_table(tmp_path / "short.json")
    d["format"] = "other"
    (tmp_path / "fmt.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="not a netsim-compute-table"):
        load_table(tmp_path / "fmt.json")
