"""scripts/replay_steps.py: a served run's recorded steps against the replay's all-to-all time
(measured side by hand; the model side is netsim.replay's own function, tested in test_replay)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netsim.conftest import table_csv

REPO = Path(__file__).resolve().parents[2]


def _inputs(tmp_path, with_end=True):
    spans = tmp_path / "spans"
    spans.mkdir()
    steps = [  # a lone prefill of 40 tokens on rank 0, then a decode step on both ranks
        ([{"t": 0.0, "end": 0.10, "tokens": 40, "bytes": 8000, "spans": [["dispatch", 0.02, 0.05], ["combine", 0.07, 0.08]]},
          {"t": 0.0, "end": 0.10, "tokens": 0, "bytes": 8000, "spans": [["dispatch", 0.03, 0.05], ["combine", 0.06, 0.09]]}]),
        ([{"t": 0.2, "end": 0.25, "tokens": 2, "bytes": 1000, "spans": [["dispatch", 0.21, 0.22], ["combine", 0.23, 0.24]]},
          {"t": 0.2, "end": 0.25, "tokens": 1, "bytes": 1000, "spans": [["dispatch", 0.21, 0.22], ["combine", 0.23, 0.24]]}]),
    ]
    for r in range(2):
        lines = [dict(step[r]) for step in steps]
        if not with_end:
            for line in lines:
                del line["end"]
        (spans / f"a2a_spans_rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    prof = {"schema": "serving-compute-profile/1", "ranks": 2, "engine": {"max_batch_tokens": 64, "max_requests": 4},
            "variants": {"standard": {"fixed_s": 0.01, "per_token_s": 1e-4, "per_request_s": 1e-3, "dummy_s": 0.005,
                                      "a2a_bytes_per_token": 200.0, "a2a_calls": 2, "iteration_s": 0.003,
                                      "layout_decode": [0.5, 0.25, 0.25], "layout_prefill": [0.4, 0.2, 0.4]}}}
    (tmp_path / "p.json").write_text(json.dumps(prof))
    table = [table_csv(tmp_path, "both", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)]),
             table_csv(tmp_path, "one", 0.5, 0.0, [(2000, 0.0008), (8000, 0.004)], one_way=True)]
    return spans, tmp_path / "p.json", table


def test_steps_are_grouped_and_measured_without_rank_skew(tmp_path):
    spans, prof, table = _inputs(tmp_path)
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "scripts/replay_steps.py", "--spans", str(spans), "--profile", str(prof),
                           "--variant", "standard", "--link-table", *table, "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    by = json.loads(out.read_text())["by_kind"]
    # per call: the last rank's exit minus the last rank's entry
    assert by["dummy"]["steps"] == 1 and by["dummy"]["measured_s"] == pytest.approx((0.05 - 0.03) + (0.09 - 0.07))
    assert by["decode"]["measured_s"] == pytest.approx(0.01 + 0.01)
    assert by["dummy"]["bytes_measured"] == 8000 and by["decode"]["bytes_measured"] == 1000
    # model bytes: d = 100 B per token one way; rank 0 sends d x 64 (padded) and gets back d x 64
    assert by["dummy"]["bytes_model"] == pytest.approx(100 * 64)
    assert by["dummy"]["replay_s"] > 0
    assert json.loads(out.read_text())["between_steps"] is None  # no loop records


def test_the_loops_exchange_between_steps(tmp_path):
    """With the loop's records (``loop_rank<R>.jsonl``): per kind of iteration that stepped, each
    rank's phases (median and mean) and what each replay version charges for such an iteration."""
    from tools.profile.replay_steps import loop_summary

    def rec(arrived, gathered, header, stepped=True):
        return {"t": 0.0, "arrived": arrived, "gathered": gathered, "stepped": stepped,
                "phases": {"work": 1e-4, "header": header, "broadcast": 2e-3 if arrived else 0.0,
                           "gather": 1e-3 if gathered else 0.0, "adds": 1e-4, "step": 0.05}}

    rank0 = [rec(2, False, 1e-3), rec(0, True, 1e-3), rec(0, True, 3e-3), rec(0, True, 2e-3, stepped=False)]
    got = loop_summary([rank0, rank0[:2]], lambda arrived, gathered: {"v": 1e-3 * (1 + arrived + gathered)})
    assert set(got) == {"arrived", "gathered"}  # the iteration that did not step is left out
    gathered = got["gathered"]["ranks"]["0"]
    assert gathered["n"] == 2 and gathered["header"]["median_s"] == pytest.approx(2e-3)
    assert gathered["exchange"]["mean_s"] == pytest.approx(1e-4 + 2e-3 + 1e-3 + 1e-4)
    assert got["gathered"]["ranks"]["1"]["n"] == 1 and got["arrived"]["replay_s"] == {"v": 2e-3}
    # through the command: the replay's charge per version, printed and written
    spans, prof, table = _inputs(tmp_path)
    for r in range(2):
        (spans / f"loop_rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rank0))
    out = tmp_path / "out.json"
    from tools.profile.replay_steps import main

    assert main(["--spans", str(spans), "--profile", str(prof), "--variant", "standard", "--link-table", *table,
                 "--fit", str(REPO / "examples/netsim/gloo_netns_fit.json"), "--json", str(out)]) == 0
    between = json.loads(out.read_text())["between_steps"]
    small = 0.001  # the table's smallest message (2000 B both ways: 1 ms)
    assert between["arrived"]["replay_s"]["replay/8"] == pytest.approx(0.003 + 2 * small)
    assert between["gathered"]["replay_s"]["replay/8"] == pytest.approx(0.003 + 2 * small)
    assert between["gathered"]["replay_s"]["replay/7"] > 0.003
    # totals over the iterations that stepped (each record starts at 0 s: none lies on a recorded step)
    totals = json.loads(out.read_text())["loop_totals"]
    assert totals[0]["iterations"] == 3 and totals[0]["step_s"] == pytest.approx(0.15)
    assert totals[1]["iterations"] == 3 and totals[0]["beyond_span"]["n"] == 0  # both ranks wrote rank0


def test_a_step_beyond_its_span():
    """The loop's step phase against the step's recorded span: what the engine does after the forward."""
    from tools.profile.replay_steps import loop_totals

    spans = [{"t": 1.0, "end": 1.04}, {"t": 2.0, "end": 2.03}]
    loops = [{"t": 0.99, "stepped": True, "phases": {"header": 0.01, "step": 0.045}},
             {"t": 1.99, "stepped": True, "phases": {"header": 0.01, "step": 0.032}},
             {"t": 2.5, "stepped": False, "phases": {"header": 0.01, "step": 0.0}}]
    (got,) = loop_totals([spans], [loops])
    assert got["iterations"] == 2 and got["step_s"] == pytest.approx(0.077)
    assert got["exchange_s"] == pytest.approx(0.02)
    assert got["beyond_span"]["n"] == 2 and got["beyond_span"]["mean_s"] == pytest.approx((0.005 + 0.002) / 2)


@pytest.mark.slow  # starts processes
def test_spans_without_step_ends_and_unknown_variants_are_one_line(tmp_path):
    spans, prof, table = _inputs(tmp_path, with_end=False)
    proc = subprocess.run([sys.executable, "scripts/replay_steps.py", "--spans", str(spans), "--profile", str(prof),
                           "--variant", "standard", "--link-table", *table], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--spans" in proc.stderr
    proc = subprocess.run([sys.executable, "scripts/replay_steps.py", "--spans", str(spans), "--profile", str(prof),
                           "--variant", "bigmac", "--link-table", *table], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "bigmac" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    (tmp_path / "ended").mkdir()
    spans, _, _ = _inputs(tmp_path / "ended", with_end=True)
    p = json.loads(prof.read_text())
    del p["variants"]["standard"]["layout_decode"]  # a profile from before the measured layouts
    prof.write_text(json.dumps(p))
    proc = subprocess.run([sys.executable, "scripts/replay_steps.py", "--spans", str(spans), "--profile", str(prof),
                           "--variant", "standard", "--link-table", *table], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "no layout_decode" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_tp_engine_counts_its_tp_collectives(tmp_path):
    """At TP = EP = 2 both ranks hold the step's tokens; the spans' TP all-reduce and gather count
    among the measured collectives (last entry to last exit), not the compute; the gather's bytes
    give the step's requests. Wall and compute are summed so the rank-skew wait is what is left."""
    spans, prof, table = _inputs(tmp_path)
    step = [{"t": 0.0, "end": 0.10, "tokens": 40, "bytes": 8000,
             "spans": [["dispatch", 0.02, 0.05], ["combine", 0.06, 0.08]],
             "tp": [["all_reduce", 4096, 0.01, 0.015], ["all_gather", 200, 0.085, 0.09]]},
            {"t": 0.0, "end": 0.11, "tokens": 40, "bytes": 8000,
             "spans": [["dispatch", 0.03, 0.05], ["combine", 0.06, 0.09]],
             "tp": [["all_reduce", 4096, 0.012, 0.015], ["all_gather", 200, 0.095, 0.1]]}]
    for r in range(2):
        (spans / f"a2a_spans_rank{r}.jsonl").write_text(json.dumps(step[r]) + "\n")
    p = json.loads(prof.read_text())
    p["variants"]["standard"].update(tp=2, tp_allreduces=1, tp_allreduce_bytes_per_token=64.0, tp_gathers=1,
                                     tp_gather_bytes_per_request=100.0, layout_decode=[0.2] * 5,
                                     layout_prefill=[0.2] * 5)  # reduce, dispatch, combine, gather
    prof.write_text(json.dumps(p))
    ar = table_csv(tmp_path, "ar", 0.5, 0.0, [(1000, 0.001), (8000, 0.004)], op="all_reduce")
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "scripts/replay_steps.py", "--spans", str(spans), "--profile", str(prof),
                           "--variant", "standard", "--link-table", *table, ar, "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(out.read_text())["by_kind"]["prefill"]
    assert row["measured_s"] == pytest.approx((0.05 - 0.03) + (0.09 - 0.06) + (0.015 - 0.012) + (0.1 - 0.095))
    # compute: the slower rank's step minus its own collectives
    assert row["compute_s"] == pytest.approx(0.11 - (0.02 + 0.03) - (0.003 + 0.005))
    assert row["wall_s"] == pytest.approx(0.11) and row["replay_s"] > 0
