"""``python -m netsim versions``: every replay version on the runs given, per run and pooled, and the
time accounting (the synthetic run of test_validation)."""

from __future__ import annotations

import json

import pytest

from netsim.replay import MODELS
from netsim.versions import pooled
from tests.netsim.conftest import link_table_paths
from tests.netsim.test_validation import _profile, _run


def test_versions_compares_every_version_and_accounts_for_the_time(tmp_path, capsys):
    from netsim.cli import main

    run = _run()
    run["variants"]["standard"]["engine_busy_s"] = 0.5
    for r in run["requests"]["standard"]["rate-2"]:
        r["e2e_s"] = 0.3
    (tmp_path / "serve.json").write_text(json.dumps(run))
    (tmp_path / "serve.profile.json").write_text(json.dumps(
        {"schema": "serving-compute-profile/1", "variants": {"standard": _profile()}}))
    tables = link_table_paths(tmp_path)
    fit = "examples/netsim/gloo_netns_fit.json"
    for version in MODELS:
        out = tmp_path / f"v{version[7]}.json"
        assert main(["validate", "--bench-serve", str(tmp_path / "serve.json"), "--link-table", *tables, "--fit", fit,
                     "--model-version", version, "--json", str(out)]) == 0
    assert main(["versions", f"synthetic={tmp_path / 'v8.json'}", "--json", str(tmp_path / "cmp.json")]) == 0
    got = json.loads((tmp_path / "cmp.json").read_text())
    assert got["versions"] == list(MODELS)
    for version in MODELS:
        # the same validation as `validate --model-version`
        alone = json.loads((tmp_path / f"v{version[7]}.json").read_text())
        by = got["runs"]["synthetic"][version]
        assert by["validation"]["rows"] == alone["rows"]
        assert got["pooled"][version] == pooled([alone])
        acc = by["accounting"]["standard"]
        assert acc["busy_s"]["measured"] == 0.5 and acc["busy_s"]["replay"] > 0 and acc["steps"] > 0
        # the measured span: the first send (0 s) to the last answer (sent at 2.5 s, answered 0.3 s later)
        assert acc["span_s"]["measured"] == pytest.approx(2.8) and acc["span_s"]["replay"] > 2.5
    assert "replay/8 (2026-12-03) pooled" in capsys.readouterr().out
    assert main(["versions", "no-equals-sign"]) == 2
    err = capsys.readouterr().err
    assert "expected NAME=VALIDATE_JSON" in err and len(err.strip().splitlines()) == 1


def test_pooled_counts_and_signs():
    rows = [{"figure": "ttft_p50_s", "counted": True, "relative_error": e} for e in (-0.2, -0.1, 0.3)]
    rows.append({"figure": "ttft_p50_s", "counted": False, "relative_error": 5.0})
    got = pooled([{"rows": rows}])["ttft_p50_s"]
    assert got == {"points": 3, "low": 2, "mean_abs_rel_error": pytest.approx(0.2), "median_rel_error": -0.1}
