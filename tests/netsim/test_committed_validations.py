"""The replay reproduces every validation docs/results/netsim.md reports: each run of
``docs/figures/netsim_validation/<run>/`` is predicted again from its committed run, profile and
link table by the replay model version it names, and must give the committed ``validate.json``'s
figures exactly (the model's arithmetic is fixed per version: a change to it needs a new version in
``netsim.replay.MODELS``, and every earlier version keeps reproducing its results)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from netsim.link_table import LinkTable
from netsim.replay import MODELS
from netsim.validation import load_fit, predict_run, profile_path, read_json, validate_run

REPO = Path(__file__).resolve().parents[2]
RUNS = sorted(p.parent for p in (REPO / "docs" / "figures" / "netsim_validation").glob("*/validate.json"))
# every validation beside a run: its own (validate.json) and any by an earlier model version
VALIDATIONS = sorted((REPO / "docs" / "figures" / "netsim_validation").glob("*/validate*.json"))


ROUND2 = [f"r2_{b}{w}" for b in ("b1", "b2") for w in ("", "_link", "_prompts", "_ep", "_width")]


def test_every_run_of_docs_netsim_is_here():
    assert {p.name for p in RUNS} == {"heldout_composed", "heldout_semmoe", "heldout_composed2", "heldout_tp",
                                      "heldout_tp2", "heldout_composed3", "heldout_semmoe2", "shaping1", "shaping2",
                                      "serving_composed", "semmoe_recorded", "ooc_n1", "ooc_n2", "ooc_n3", "ooc_n4",
                                      "loop_trace", *ROUND2}


@pytest.mark.parametrize("path", VALIDATIONS, ids=[f"{p.parent.name}/{p.name}" for p in VALIDATIONS])
def test_the_committed_validation_is_what_the_replay_gives(path):
    run_dir = path.parent
    committed = json.loads(path.read_text())
    assert committed["model_version"] in MODELS
    serve = run_dir / "serve.json.gz"
    if not serve.exists():  # a run another doc cites keeps its place; its validation names it
        serve = REPO / committed["bench_serve"]
    run = read_json(str(serve), "run")
    # the profile it names (a what-if predicted from its base's profile), else the one beside the run
    profile = read_json(str(REPO / committed["profile"]) if "profile" in committed else profile_path(str(serve)),
                        "profile")
    table = LinkTable.from_calibrations([str(REPO / p) for p in committed["link_table"]])
    pred = predict_run(run, profile["variants"], load_fit(str(REPO / committed["fit"])), table,
                       committed["model_version"])
    assert pred == committed["predicted"]
    got = validate_run(run, pred, committed["model_version"])
    assert got["rows"] == committed["rows"] and got["by_figure"] == committed["by_figure"]


@pytest.mark.parametrize("report", ["ooc_report.json", "round2_report.json"])
def test_the_out_of_configuration_reports_are_what_their_validations_give(report):
    """``docs/figures/netsim_validation/{ooc,round2}_report.json`` (``python -m netsim report``) are
    recomputed from the committed validations and their runs, the what-if pairs included."""
    from netsim.report import configuration_report, whatif_pair

    committed = json.loads((REPO / "docs" / "figures" / "netsim_validation" / report).read_text())
    validations = {}
    for rep in committed["configurations"]:
        validation = json.loads((REPO / rep["bench_serve"]).parent.joinpath("validate.json").read_text())
        assert validation["model_version"] == rep["model_version"] and rep["model_version"] in MODELS
        run = read_json(str(REPO / rep["bench_serve"]), "run")
        assert configuration_report(rep["name"], validation, run) == rep
        validations[rep["name"]] = validation
    for pair in committed.get("pairs", []):
        assert whatif_pair(pair["base"], validations[pair["base"]], pair["whatif"], validations[pair["whatif"]]) == pair
