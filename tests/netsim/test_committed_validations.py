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


def test_every_run_of_docs_netsim_is_here():
    assert {p.name for p in RUNS} == {"heldout_composed", "heldout_semmoe", "heldout_composed2", "heldout_tp",
                                      "heldout_tp2", "heldout_composed3", "heldout_semmoe2", "shaping1", "shaping2",
                                      "serving_composed", "semmoe_recorded", "ooc_n1", "ooc_n2", "ooc_n3", "ooc_n4",
                                      "loop_trace"}


@pytest.mark.parametrize("path", VALIDATIONS, ids=[f"{p.parent.name}/{p.name}" for p in VALIDATIONS])
def test_the_committed_validation_is_what_the_replay_gives(path):
    run_dir = path.parent
    committed = json.loads(path.read_text())
    assert committed["model_version"] in MODELS
    serve = run_dir / "serve.json.gz"
    if not serve.exists():  # a run another doc cites keeps its place; its validation names it
        serve = REPO / committed["bench_serve"]
    run = read_json(str(serve), "run")
    profile = read_json(profile_path(str(serve)), "profile")
    table = LinkTable.from_calibrations([str(REPO / p) for p in committed["link_table"]])
    pred = predict_run(run, profile["variants"], load_fit(str(REPO / committed["fit"])), table,
                       committed["model_version"])
    assert pred == committed["predicted"]
    got = validate_run(run, pred, committed["model_version"])
    assert got["rows"] == committed["rows"] and got["by_figure"] == committed["by_figure"]


def test_the_out_of_configuration_report_is_what_its_validations_give():
    """``docs/figures/netsim_validation/ooc_report.json`` (``python -m netsim report``) is recomputed
    from the committed validations and their runs."""
    from netsim.report import configuration_report

    committed = json.loads((REPO / "docs" / "figures" / "netsim_validation" / "ooc_report.json").read_text())
    for rep in committed["configurations"]:
        validation = json.loads((REPO / rep["bench_serve"]).parent.joinpath("validate.json").read_text())
        assert validation["model_version"] == rep["model_version"] and rep["model_version"] in MODELS
        run = read_json(str(REPO / rep["bench_serve"]), "run")
        assert configuration_report(rep["name"], validation, run) == rep
