"""``python -m tools.profile.exposed``: a served run's exposed expert communication per MoE layer and
collective, from the spans and waits ``serve --a2a-spans`` records (worked by hand)."""

from __future__ import annotations

import json

import pytest

from tools.profile.exposed import by_kind, exposed_by_layer, main

# two MoE layers: dispatch 0 fully hidden, combine 0 waited for from its midpoint, dispatch 1
# waited for before it launched (all exposed), combine 1 never waited for (after the step's end)
STEP = {"t": 0.0, "end": 1.0, "tokens": 100, "spans": [["dispatch", 0.10, 0.20], ["combine", 0.30, 0.50],
                                                       ["dispatch", 0.60, 0.70], ["combine", 0.80, 0.90]],
        "waits": [["dispatch", 0.25, 0.25], ["combine", 0.40, 0.50], ["dispatch", 0.55, 0.70]]}


def test_exposed_time_per_layer_and_collective():
    got = exposed_by_layer([[STEP], [dict(STEP, tokens=4)]], min_tokens=64)  # rank 1's step is a decode step
    assert got["steps"] == 1
    d, c = got["collectives"]["dispatch"], got["collectives"]["combine"]
    assert d["0"]["exposed_s"] == 0.0 and d["1"]["exposed_s"] == pytest.approx(0.10)
    assert c["0"]["exposed_s"] == pytest.approx(0.10) and c["1"]["exposed_s"] == 0.0
    assert got["in_flight_s"] == pytest.approx(0.5) and got["hidden"] == pytest.approx(1 - 0.2 / 0.5)
    both = exposed_by_layer([[STEP], [STEP]])
    assert both["steps"] == 2 and both["collectives"]["dispatch"]["1"]["n"] == 2
    kinds = by_kind(got)  # per kind, and the last MoE layer apart
    assert kinds["dispatch"]["exposed_s"] == pytest.approx(0.10) and kinds["dispatch"]["share_of_exposed"] == 0.5
    assert kinds["combine"]["hidden"] == pytest.approx(1 - 0.1 / 0.3)
    assert kinds["combine"]["last_layer"] == {"layer": 1, "in_flight_s": pytest.approx(0.1), "exposed_s": 0.0,
                                              "share_of_exposed": 0.0}


def test_the_command(tmp_path, capsys):
    spans = tmp_path / "a2a_spans"
    spans.mkdir()
    (spans / "a2a_spans_rank0.jsonl").write_text(json.dumps(STEP) + "\n")
    assert main(["--spans", str(spans), "--json", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    assert "1 rank-steps: 500.0 ms in flight, 200.0 ms exposed, 60.0% hidden" in out
    written = json.loads((tmp_path / "e.json").read_text())
    assert written["schema"] == "exposed-by-layer/2" and written["by_kind"]["dispatch"]["last_layer"]["layer"] == 1
    assert main(["--spans", str(spans), "--spans", str(spans)]) == 0  # two runs pooled
    assert "2 rank-steps: 1000.0 ms in flight, 400.0 ms exposed, 60.0% hidden" in capsys.readouterr().out
    old = dict(STEP)
    del old["waits"]
    (spans / "a2a_spans_rank0.jsonl").write_text(json.dumps(old) + "\n")
    assert main(["--spans", str(spans)]) == 2
    err = capsys.readouterr().err
    assert "no waits" in err and len(err.strip().splitlines()) == 1
    assert main(["--spans", str(tmp_path / "nowhere")]) == 2
