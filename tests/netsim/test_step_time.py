"""``python -m tools.profile.step_time``: a served step's wall time split into expert all-to-alls in
flight (transfer and rank-skew wait), TP collectives outside them and the rest, per rank and run."""

from __future__ import annotations

import json

import pytest

from tools.profile.step_time import main, rank_time, run_time


def _step(t, dispatch, tp=()):
    return {"t": t, "end": t + 1.0, "tokens": 4, "bytes": 400, "spans": [["dispatch", *dispatch]],
            "tp": [list(x) for x in tp]}


RANK0 = [_step(0.0, (0.1, 0.3), [("all_reduce", 800, 0.25, 0.5)]), _step(1.0, (1.1, 1.2))]
RANK1 = [_step(0.0, (0.2, 0.3), [("all_reduce", 800, 0.3, 0.4)]), _step(1.0, (1.1, 1.2))]


def test_one_rank_counts_tp_time_outside_the_all_to_alls_only():
    got = rank_time(RANK0)
    assert got["steps"] == 2 and got["tokens"] == 8 and got["a2a_bytes"] == 800
    assert got["wall_s"] == pytest.approx(2.0)
    assert got["a2a_s"] == pytest.approx(0.3)  # 0.2 + 0.1
    assert got["tp_s"] == pytest.approx(0.2)  # the all-reduce's 0.25-0.5 less its overlap with the dispatch
    assert got["rest_s"] == pytest.approx(1.5)
    assert got["tp"] == {"all_reduce": {"calls": 1, "bytes": 800, "s": pytest.approx(0.25)}}


def test_a_run_means_its_ranks_and_splits_transfer_from_skew():
    got = run_time([RANK0, RANK1])
    # rank 0's first dispatch waits 0.1 s for rank 1's launch: transfer 0.1 + 0.1, skew 0.1 (rank 1: none)
    assert got["transfer_share"] == pytest.approx((0.2 / 2 + 0.2 / 2) / 2)
    assert got["skew_share"] == pytest.approx((0.1 / 2 + 0.0) / 2)
    assert got["a2a_share"] == pytest.approx(got["transfer_share"] + got["skew_share"])
    assert got["a2a_share"] + got["tp_share"] + got["rest_share"] == pytest.approx(1.0)
    assert got["tp_bytes_per_token"] == {"all_reduce": pytest.approx(100.0)}
    assert run_time([RANK0, RANK1[:1]])["transfer_share"] is None  # steps not matched: no split


def test_the_command(tmp_path, capsys):
    spans = tmp_path / "a2a_spans"
    spans.mkdir()
    for r, steps in enumerate((RANK0, RANK1)):
        (spans / f"a2a_spans_rank{r}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert main(["--spans", str(spans), "--spans", str(spans), "--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "all_reduce" in out and "wrote" in out
    written = json.loads((tmp_path / "t.json").read_text())
    assert written["schema"] == "step-time/1" and written["n"] == 2
    assert written["median"]["transfer_share"] == pytest.approx(0.1)
    (spans / "a2a_spans_rank1.jsonl").write_text("")
    assert main(["--spans", str(spans)]) == 2
    err = capsys.readouterr().err
    assert "recorded no steps" in err and len(err.strip().splitlines()) == 1
    assert main(["--spans", str(tmp_path / "nowhere")]) == 2
