"""``python -m netsim report``: the pooled errors are the validation's, and each repeat's error is
computed over the same counted points against that repeat's own figures."""

import json

import pytest

from netsim.cli import main
from netsim.report import configuration_report, format_report


def _validation(bench_serve: str) -> dict:
    rows = [
        {"variant": "standard", "rate": "2", "figure": "ttft_p50_s", "measured": 0.1, "predicted": 0.11,
         "relative_error": 0.1, "counted": True},
        {"variant": "standard", "rate": "2", "figure": "output_tokens_per_s", "measured": 100.0, "predicted": 150.0,
         "relative_error": 0.5, "counted": False},  # offered-load bound: not counted, not in any repeat either
        {"variant": "standard", "rate": "2", "figure": "tpot_p50_s", "measured": 0.05, "predicted": 0.04,
         "relative_error": -0.2, "counted": True},
    ]
    return {"schema": "netsim-validate/1", "bench_serve": bench_serve, "rows": rows, "model_version": "m/1",
            "code_version": "abc", "mean_abs_rel_error": 0.15, "max_abs_rel_error": 0.2, "points": 2,
            "by_figure": {"ttft_p50_s": {"mean_abs_rel_error": 0.1, "max_abs_rel_error": 0.1, "points": 1},
                          "tpot_p50_s": {"mean_abs_rel_error": 0.2, "max_abs_rel_error": 0.2, "points": 1},
                          "output_tokens_per_s": {"mean_abs_rel_error": None, "max_abs_rel_error": None, "points": 0}}}


def _run() -> dict:
    def rep(ttft, tpot, loaded):
        return {"variants": {"standard": {"2": {"ttft_s.p50": ttft, "tpot_s.p50": tpot, "output_tokens_per_s": 1.0}}},
                "load": {"standard": {"loaded": loaded}}}

    return {"runs": [rep(0.11, 0.04, False), rep(0.055, 0.05, True), rep(0.22, 0.08, False)]}


def test_each_repeat_is_compared_over_the_counted_points():
    report = configuration_report("X", _validation("serve.json"), _run())
    ttft, tpot = report["figures"]["ttft_p50_s"], report["figures"]["tpot_p50_s"]
    assert ttft["pooled"] == 0.1 and ttft["per_run"] == pytest.approx([0.0, 1.0, 0.5])
    assert ttft["run_range"] == pytest.approx([0.0, 1.0])
    assert tpot["per_run"] == pytest.approx([0.0, 0.2, 0.5])
    assert report["figures"]["output_tokens_per_s"]["per_run"] == [None, None, None]
    assert report["all"]["per_run"] == pytest.approx([0.0, 0.6, 0.5])
    assert (report["repeats"], report["loaded_marks"], report["measurements"]) == (3, 1, 3)
    table = format_report([report], goal=0.15)
    assert "| X | ttft_p50_s | 10.0% | 0.0% - 100.0% (n = 3) | 10.0% | 1 |" in table
    assert table.endswith("missed by X tpot_p50_s")  # 15.0% overall is not above the goal


def test_the_command_reads_the_validation_and_its_run(tmp_path, capsys):
    (tmp_path / "serve.json").write_text(json.dumps(_run()))
    (tmp_path / "v.json").write_text(json.dumps(_validation(str(tmp_path / "serve.json"))))
    assert main(["report", f"X={tmp_path / 'v.json'}", "--goal", "0.25", "--json", str(tmp_path / "r.json")]) == 0
    assert "goal (every pooled figure <= 25.0%): met" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["configurations"][0]["name"] == "X"
    assert main(["report", "no-equals-sign"]) == 2
    assert "expected NAME=VALIDATE_JSON" in capsys.readouterr().err
    (tmp_path / "not.json").write_text("not json")
    for bad, said in ((tmp_path / "missing.json", "No such file"), (tmp_path / "not.json", "Expecting value")):
        assert main(["report", f"X={bad}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0] and str(bad) in err[0], err


def test_a_whatif_pair_compares_the_changes():
    """The base measured TTFT 0.1 s (predicted 0.11), the what-if 0.2 s (predicted 0.2): the run
    doubled, the model predicted x1.82, so the predicted change is 9.1% short."""
    from netsim.report import format_pairs, whatif_pair

    base = _validation("a.json")
    whatif = _validation("b.json")
    whatif["rows"][0] = dict(whatif["rows"][0], measured=0.2, predicted=0.2)
    pair = whatif_pair("B", base, "W", whatif)
    ttft = next(p for p in pair["points"] if p["figure"] == "ttft_p50_s")
    assert ttft["measured_change"] == pytest.approx(2.0) and ttft["predicted_change"] == pytest.approx(0.2 / 0.11)
    assert pair["figures"]["ttft_p50_s"] == pytest.approx(abs(0.2 / 0.11 / 2.0 - 1))
    assert pair["figures"]["tpot_p50_s"] == pytest.approx(0.0)  # unchanged on both sides
    assert pair["figures"]["output_tokens_per_s"] is None  # not counted in either
    assert "| W vs B | ttft_p50_s | x2.00-x2.00 | 9.1% | 1 |" in format_pairs([pair])


def test_the_command_reports_pairs(tmp_path, capsys):
    (tmp_path / "serve.json").write_text(json.dumps(_run()))
    (tmp_path / "v.json").write_text(json.dumps(_validation(str(tmp_path / "serve.json"))))
    args = ["report", f"B={tmp_path / 'v.json'}", f"W={tmp_path / 'v.json'}", "--json", str(tmp_path / "r.json")]
    assert main(args + ["--pairs", "B:W"]) == 0
    assert "| W vs B | tpot_p50_s | x1.00-x1.00 | 0.0% | 1 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["pairs"][0]["whatif"] == "W"
    assert main(args + ["--pairs", "B:Z"]) == 2
    err = capsys.readouterr().err
    assert "--pairs B:Z: expected BASE:WHATIF among the names given (B, W)" in err
    assert len(err.strip().splitlines()) == 1
