"""``python -m netsim`` commands run in-process (and one subprocess check that netsim never imports torch)."""

import json
import re
import subprocess
import sys

import pytest

from netsim.cli import main


def test_collectives_cost_serve(capsys):
    assert main(["collectives", "--topology", "torus3d", "--num-xpus", "64", "--bytes", "1024,1e8"]) == 0
    out = capsys.readouterr().out
    assert "halfring" in out and "p2p" in out
    assert main(["cost", "--topology", "scale-up", "--num-xpus", "256"]) == 0
    out = capsys.readouterr().out
    assert "switch_capex" in out and "switches: 192" in out
    assert main(["serve", "--topology", "fullmesh3d", "--tpot-ms", "40", "--context", "512", "--bigmac-ratio", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "tok/s/XPU" in out and "max batch by memory" in out


def test_fit_on_synthetic_csv(tmp_path, capsys):
    csv = tmp_path / "syn.csv"
    assert main(["synth-collectives", "--out", str(csv), "--tier", "inter", "--bandwidth-gbps", "50", "--noise", "0.02"]) == 0
    capsys.readouterr()
    out_json = tmp_path / "fit.json"
    assert main(["fit", "--csv", str(csv), "--bandwidth-gbps", "50", "--out", str(out_json), "--show-rows"]) == 0
    out = capsys.readouterr().out
    assert "mean relative error" in out
    d = json.loads(out_json.read_text())
    assert d["mean_relative_error"] < 0.03
    assert d["constants"]["utilization"] == pytest.approx(0.843, rel=0.1)
    # the fitted constants feed the other commands
    assert main(["collectives", "--constants", str(out_json), "--bytes", "1e6"]) == 0


def test_compute_table_and_projection(tmp_path, capsys):
    h = tmp_path / "h100.json"
    assert main(["compute-table", "--out", str(h), "--gemm-compute", "0.5"]) == 0
    r = tmp_path / "rubin.json"
    assert main(["compute-table", "--project", str(h), "--gpu", "rubin", "--out", str(r)]) == 0
    d = json.loads(r.read_text())
    assert d["provenance"]["method"] == "roofline-estimate" and "projected_to" in d["provenance"]
    assert main(["serve", "--table", str(h), "--tpot-ms", "100"]) == 0


def test_sweep_quick_writes_outputs(tmp_path, capsys):
    out = tmp_path / "sw"
    assert main(["sweep", "--out", str(out), "--quick"]) == 0
    text = capsys.readouterr().out
    assert "Pareto frontier" in text and "switchless gain" in text
    # one wall time for the whole sweep (the summary's, also sweep.json's wall_s), not a second one
    assert len(re.findall(r"(?:wall time|\bin) [0-9.]+s\b", text)) == 1, text[-500:]
    res = json.loads((out / "sweep.json").read_text())
    assert res["format"] == "netsim-sweep/1" and res["records"]
    assert (out / "summary.txt").read_text().startswith("Topologies at the 1x provision")
    for png in ("bandwidth_scaleup.png", "pareto.png", "variants.png", "topologies_1x.png"):
        assert (out / png).stat().st_size > 1000


def test_sweep_compare_to_lists_the_decisions_that_changed(tmp_path, capsys):
    """``--compare-to``: the decisions of two sweeps side by side; a sweep against itself changes
    nothing, the loop's control exchange moves every throughput down (it only adds time), and an
    edited recommendation is reported with both values."""
    import copy

    from netsim.sweep import compare_decisions, decisions

    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["sweep", "--out", str(a), "--quick", "--no-plots"]) == 0
    base = json.loads((a / "sweep.json").read_text())
    same = compare_decisions(base, base)
    assert same["changed"] == [] and same["layouts_changed"] == 0 and same["records"] == len(base["records"])
    assert main(["sweep", "--out", str(b), "--quick", "--no-plots", "--loop-control", "exchange",
                 "--compare-to", str(a / "sweep.json")]) == 0  # fmt: skip
    assert "decisions changed" in capsys.readouterr().out
    cmp = json.loads((b / "decisions.json").read_text())
    assert cmp["base"] == str(a / "sweep.json") and cmp["decisions"] == len(decisions(base)) > 10
    assert json.loads((b / "sweep.json").read_text())["config"]["serving"]["loop_control"] == "exchange"
    assert cmp["throughput_change"]["max"] <= 1e-12 and cmp["throughput_change"]["min"] < 0
    edited = copy.deepcopy(base)
    key = next(iter(edited["analyses"]["pareto"]))
    edited["analyses"]["pareto"][key]["frontier_topologies"] = ["nowhere"]
    changed = compare_decisions(base, edited)["changed"]
    assert changed == [{"decision": f"pareto frontier/{key}", "base": decisions(base)[f"pareto frontier/{key}"],
                        "new": "nowhere"}]  # fmt: skip
    for bad, why in ((tmp_path / "missing.json", "No such file"), (a / "summary.txt", "--compare-to")):
        assert main(["sweep", "--out", str(tmp_path / "c"), "--quick", "--compare-to", str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert why in err and len(err.splitlines()) == 1 and not (tmp_path / "c" / "sweep.json").exists()


def test_sweep_knobs_measured_lar_curve():
    from netsim.sweep import KNOBS, KnobSource, default_variants, knob_values

    measured = knob_values("measured")
    assert measured["lar_by_ep"] == KNOBS[KnobSource.MEASURED]["lar_by_ep"] and len(measured["lar_by_ep"]) >= 4
    semmoe = {v.name: v for v in default_variants(**measured)}["semmoe"]
    for ep, lar in measured["lar_by_ep"]:
        assert semmoe.lar_at(ep) == pytest.approx(lar)
    flat = {v.name: v for v in default_variants(**knob_values("measured", lar=0.3))}["combined"]
    assert flat.lar_by_ep == () and flat.lar_at(64) == pytest.approx(0.3)  # an explicit --lar replaces the curve
    assert knob_values("paper")["lar_by_ep"] == ()


def test_user_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("op,ranks,bytes\n")
    assert main(["fit", "--csv", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m netsim: error: ") and err.count("\n") == 1 and "missing CSV column" in err
    assert main(["fit"]) == 2
    assert main(["serve", "--lar", "1.5"]) == 2
    assert main(["fit", "--csv", str(bad), "--algorithm", "ring"]) == 2


def test_a_bug_inside_a_command_keeps_its_traceback(monkeypatch, capsys):
    """A ``ValueError`` from the model itself is a bug, not bad input: no one-line ``error:``."""
    import netsim.cost

    def cluster_cost(*args, **kwargs):
        raise ValueError("a bug in the cost model")

    monkeypatch.setattr(netsim.cost, "cluster_cost", cluster_cost)
    with pytest.raises(ValueError, match="a bug in the cost model"):
        main(["cost"])
    assert "error:" not in capsys.readouterr().err


def test_netsim_does_not_import_torch():
    code = ("import sys, netsim, netsim.cli, netsim.sweep, netsim.plots; "
            "netsim.cli.main(['cost']); assert 'torch' not in sys.modules, 'torch imported'")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_measured_knobs_are_the_committed_measurements():
    """The sweep's measured knobs are copies of figures in docs/figures; they must not drift from them."""
    import os

    from netsim.sweep import KNOBS, KnobSource

    figures = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "figures")
    knobs = KNOBS[KnobSource.MEASURED]
    for ep, lar in knobs["lar_by_ep"]:
        with open(os.path.join(figures, "semmoe_dsv2", f"eval_ep{ep}.json")) as f:
            row = [r for r in json.load(f)["results"] if r["method"] == "semmoe" and r["mode"] == "tp"][0]
        assert lar == pytest.approx(row["lar"], abs=5e-5), ep
    with open(os.path.join(figures, "bench_serve_dsv2lite_decode27.json")) as f:
        overlap = json.load(f)["variants"]["farskip"]["overlap"]
    assert knobs["farskip_overlap"] == pytest.approx(overlap, abs=5e-4)
