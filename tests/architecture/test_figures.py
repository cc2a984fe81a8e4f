"""docs/figures keeps what the docs' tables and plots are computed from, not raw dumps: no
benchmark JSON holds its per-request or per-rank lists (``python -m tools.figure_summary`` writes the
summary), no step-span dump is there, and the serving runs netsim replays are gzipped
(docs/figures/README.md). The checker is tried on hand-made files first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIGURES = REPO / "docs" / "figures"


def _script():
    from tools import figure_summary

    return figure_summary


def test_the_checker_finds_raw_lists_and_the_summary_drops_them(tmp_path):
    fs = _script()
    serve = {"schema": "bench_serve/2", "variants": {"standard": {}}, "requests": {"standard": {}}}
    ep = {"schema": "bench_ep/2", "variants": {}, "per_rank": {}}
    (tmp_path / "serve.json").write_text(json.dumps(serve))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "ep.json").write_text(json.dumps(ep))
    (tmp_path / "other.json").write_text(json.dumps({"schema": "netsim-validate/1", "requests": 3}))
    assert fs.check(str(tmp_path)) == [(str(tmp_path / "serve.json"), ["requests"]),
                                       (str(tmp_path / "sub" / "ep.json"), ["per_rank"])]
    assert fs.summary(serve) == {"schema": "bench_serve/2", "variants": {"standard": {}}, "raw_removed": ["requests"]}
    with pytest.raises(ValueError, match="no raw lists"):
        fs.summary(fs.summary(serve))
    assert fs.main([str(tmp_path / "serve.json"), str(tmp_path / "serve.json")]) == 0
    assert fs.main(["--check", str(tmp_path)]) == 1  # ep.json still holds its lists
    assert fs.main([str(tmp_path / "sub" / "ep.json"), str(tmp_path / "sub" / "ep.json")]) == 0
    assert fs.main(["--check", str(tmp_path)]) == 0


def test_committed_figures_hold_no_raw_lists():
    assert _script().check(str(FIGURES)) == []


def test_no_span_dumps_and_the_replayed_runs_are_gzipped():
    assert sorted(FIGURES.rglob("a2a_spans*")) == []
    runs = sorted((FIGURES / "netsim_validation").glob("*/serve.json*"))
    assert runs and all(p.name == "serve.json.gz" for p in runs)
