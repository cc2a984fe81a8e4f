"""Time to quality (scripts/time_to_quality.py): the curve arithmetic on synthetic curves (exact up to
float rounding, compared with pytest.approx's default 1e-6 relative), the metrics file of a resumed
run, the plot, and one tiny end-to-end run over loopback (slow)."""

import json
import os
import subprocess
import sys

import pytest

from tools import repo_root
from tools.bench.ttq import Curve, load_curve, plot_curves, summarize_curves, time_to_target


def _curve(step_s, evals, done=True):
    return Curve(step_time_s={s: step_s for s in range(1, max(evals) + 1)}, evals=dict(evals), done=done)


def test_clock_is_the_sum_of_step_times_up_to_each_evaluation():
    c = Curve(step_time_s={1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}, evals={2: 50.0, 4: 40.0}, done=True)
    assert c.points() == [(2, 3.0, 50.0), (4, 10.0, 40.0)]
    with pytest.raises(ValueError, match="no time recorded for step 3"):
        Curve(step_time_s={1: 1.0, 2: 1.0}, evals={4: 1.0}, done=False).points()


def test_time_to_target_interpolates_between_the_evaluations_around_the_crossing():
    points = [(10, 100.0, 60.0), (20, 200.0, 40.0), (30, 300.0, 30.0)]
    got = time_to_target(points, 50.0)  # halfway from 60 to 40
    assert got == {"clock_s": pytest.approx(150.0), "step": pytest.approx(15.0), "interpolated": True}
    assert time_to_target(points, 40.0) == {"clock_s": 200.0, "step": 20.0, "interpolated": False}
    assert time_to_target(points, 70.0) == {"clock_s": 100.0, "step": 10.0, "interpolated": False}
    assert time_to_target(points, 29.0) is None


def test_summary_speedup_against_the_baselines_best():
    """standard: 1 s/step, best 30 at step 30 (clock 30 s). fast: 0.5 s/step, worse per step (40, 32,
    28 at steps 10/20/30): it crosses 30 halfway between step 20 (10 s) and 30 (15 s), at 12.5 s:
    2.4x faster to standard's best while 2x faster per step. slow never reaches it."""
    curves = {
        "standard": _curve(1.0, {10: 50.0, 20: 35.0, 30: 30.0}),
        "fast": _curve(0.5, {10: 40.0, 20: 32.0, 30: 28.0}),
        "slow": _curve(2.0, {10: 60.0, 20: 45.0, 30: 31.0}, done=False),
    }
    s = summarize_curves(curves)
    assert s["target_ppl"] == 30.0 and s["baseline"] == "standard"
    v = s["variants"]
    assert v["standard"]["to_target"]["clock_s"] == 30.0 and v["standard"]["speedup_to_target"] == 1.0
    assert v["fast"]["to_target"]["clock_s"] == pytest.approx(12.5)
    assert v["fast"]["to_target"]["step"] == pytest.approx(25.0)
    assert v["fast"]["speedup_to_target"] == pytest.approx(30.0 / 12.5)
    assert v["fast"]["speedup_per_step"] == pytest.approx(2.0)
    assert v["slow"]["to_target"] is None and v["slow"]["speedup_to_target"] is None and not v["slow"]["done"]
    assert v["fast"]["best_ppl"] == 28.0 and v["fast"]["clock_s"] == pytest.approx(15.0)
    with pytest.raises(ValueError, match="baseline"):
        summarize_curves({"fast": curves["fast"]})


def test_metrics_of_a_resumed_run_count_each_step_once_the_last_time(tmp_path):
    """A run interrupted after step 4 with its last checkpoint at step 2 repeats steps 3-4 when it
    resumes; the file then holds both sessions and the repeat is what counts."""
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "step_time_s": 1.0, "a2a_time_s": 0.25} for s in (1, 2)]
    lines += [{"event": "valid", "step": 2, "loss": 4.0, "ppl": 54.6}]
    lines += [{"step": s, "step_time_s": 9.0, "a2a_time_s": 0.25} for s in (3, 4)]
    lines += [{"event": "summary", "step": 4, "interrupted": True}]
    lines += [{"step": s, "step_time_s": 2.0, "a2a_time_s": 0.5} for s in (3, 4)]
    lines += [{"event": "valid", "step": 4, "loss": 3.0, "ppl": 20.1}, {"event": "checkpoint", "step": 4}]
    lines += [{"event": "summary", "step": 4, "interrupted": False}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    c = load_curve(str(path))
    assert c.done and c.evals == {2: 54.6, 4: 20.1}
    assert c.points() == [(2, 2.0, 54.6), (4, 6.0, 20.1)]
    assert c.a2a_share == pytest.approx(0.25)  # median of 0.25, 0.25, 0.25, 0.25 (step 1-2) and 0.25 (3-4)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    s = summarize_curves({"standard": _curve(1.0, {1: 9.0, 2: 8.0}), "bigmac": _curve(0.5, {1: 9.5, 2: 7.0})})
    path = tmp_path / "ttq.png"
    plot_curves(s, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "ttq.png.tmp.png").exists()


def _metrics(path, step_s, evals):
    """A finished run's metrics.jsonl: every step ``step_s`` seconds (a quarter in all-to-all)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [{"step": k, "step_time_s": step_s, "a2a_time_s": step_s / 4} for k in range(1, max(evals) + 1)]
    lines += [{"event": "valid", "step": k, "ppl": p} for k, p in sorted(evals.items())]
    lines += [{"event": "summary", "step": max(evals), "interrupted": False}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_runs_live_in_their_own_directories_and_are_summarized_over_runs(tmp_path, capsys):
    """Three runs of the same curves on a drifting machine (x1, x1.5, x0.8): bigmac's steps take half
    of standard's; it crosses standard's best (8.0) 0.6 of the way from step 2 (9.5) to step 4 (7.0),
    at 1.6 steps of standard's time against standard's 4: speed-up 2.5 in every run, interval
    [2.5, 2.5]; standard's clock to target follows the drift (the interval over 3 runs: their range)."""
    from tools.bench.ttq import _report, build_parser, run_dir, summarize_runs

    assert run_dir("OUT", 0, "bigmac") == os.path.join("OUT", "bigmac")
    assert run_dir("OUT", 2, "bigmac") == os.path.join("OUT", "run3", "bigmac")
    for r, drift in enumerate((1.0, 1.5, 0.8)):
        _metrics(tmp_path / run_dir("", r, "standard") / "metrics.jsonl", 1.0 * drift, {2: 9.0, 4: 8.0})
        _metrics(tmp_path / run_dir("", r, "bigmac") / "metrics.jsonl", 0.5 * drift, {2: 9.5, 4: 7.0})
    args = build_parser().parse_args(["--out", str(tmp_path), "--variants", "standard,bigmac", "--no-netns"])
    assert (args.runs, args.load_threshold, args.strict) == (3, 1.3, False)
    launches = [{"variant": "bigmac", "run": 1, "load": {"loaded": True}}]
    pytest.importorskip("matplotlib")
    result = _report(args, str(tmp_path), ["standard", "bigmac"], None, launches)
    assert [r["run"] for r in result["runs"]] == [0, 1, 2] and result["loaded_launches"] == [{"variant": "bigmac", "run": 1}]
    speedup = result["over_runs"]["bigmac"]["speedup_to_target"]
    assert (speedup["median"], speedup["ci_low"], speedup["ci_high"]) == pytest.approx((2.5, 2.5, 2.5))
    # standard reaches its best (8.0) at step 4: clock 4 x drift
    clock = result["over_runs"]["standard"]["to_target_clock_s"]
    assert clock["values"] == pytest.approx([4.0, 6.0, 3.2]) and (clock["ci_low"], clock["ci_high"]) == pytest.approx((3.2, 6.0))
    assert result["over_runs"]["bigmac"]["a2a_share_median"]["median"] == pytest.approx(0.25)
    assert result["variants"]["standard"]["to_target"]["clock_s"] == pytest.approx(4.0)  # the first run on top
    assert (tmp_path / "ttq.png").exists() and json.loads((tmp_path / "ttq.json").read_text())["runs_requested"] == 3
    assert summarize_runs([]) == {}
    from tools.bench.ttq import _print

    _print(result)
    out = capsys.readouterr().out
    assert "2.500 [2.500-2.500]" in out and "medians over 3 runs" in out and "* bigmac run 2: a launch" in out


@pytest.mark.slow
def test_tiny_run_over_loopback_is_resumable_and_writes_the_json(tmp_path):
    cmd = [sys.executable, os.path.join(repo_root(), "scripts", "time_to_quality.py"), "--out", str(tmp_path),
           "--no-netns", "--steps", "4", "--eval-interval", "2", "--eval-iters", "1", "--variants", "standard,bigmac",
           "--set", "num_layers=2", "--set", "hidden_size=32", "--set", "seq_length=32",
           "--set", "micro_batch_size=2", "--set", "global_batch_size=8", "--runs", "2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "ttq.json").read_text())
    assert data["schema"] == "time_to_quality/1" and data["baseline"] == "standard"
    assert data["link"]["shaped"] is False and data["link"]["training"]["steps"] == 4
    for name in ("standard", "bigmac"):
        v = data["variants"][name]
        assert v["done"] and v["steps_logged"] == 4 and [e["step"] for e in v["evaluations"]] == [2, 4]
        assert v["clock_s"] > 0 and v["a2a_share_median"] > 0
    assert data["variants"]["standard"]["to_target"]["step"] <= 4
    assert (tmp_path / "ttq.png").exists() and (tmp_path / "run2" / "bigmac" / "metrics.jsonl").exists()
    assert len(data["runs"]) == 2 and data["over_runs"]["bigmac"]["mean_step_s"]["n"] == 2
    assert [la["variant"] for la in data["launches"]] == ["standard", "bigmac", "bigmac", "standard"]  # rotated
    assert all("loaded" in la["load"] for la in data["launches"])
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "standard: done earlier" in again.stdout and "bigmac: done earlier" in again.stdout
    assert "bigmac (run 2): done earlier" in again.stdout
    changed = subprocess.run(cmd[:cmd.index("--steps") + 1] + ["6"] + cmd[cmd.index("--steps") + 2:],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert changed.returncode == 2 and "steps differ" in changed.stderr


def test_launch_records_survive_a_later_report(tmp_path):
    """Each launch writes ``launches/l<n>/record.json``; a report made by a later invocation (which
    only skipped finished variants) lists those launches with their load marks, not just its own."""
    from tools.bench.ttq import _report, build_parser, launch_records, run_dir
    from megatron.common.files import write_json

    _metrics(tmp_path / "standard" / "metrics.jsonl", 1.0, {2: 9.0, 4: 8.0})
    _metrics(tmp_path / "bigmac" / "metrics.jsonl", 0.5, {2: 9.5, 4: 7.0})
    for v, n, loaded in (("standard", 0, False), ("bigmac", 0, False), ("bigmac", 1, True)):
        write_json(os.path.join(run_dir(str(tmp_path), 0, v), "launches", f"l{n}", "record.json"),
                   {"variant": v, "run": 0, "launch": n, "load": {"loaded": loaded}})
    os.makedirs(tmp_path / "bigmac" / "launches" / "l2")  # a launch that died before its record
    records = launch_records(str(tmp_path), ["standard", "bigmac"], 1)
    assert [(r["variant"], r["launch"]) for r in records] == [("standard", 0), ("bigmac", 0), ("bigmac", 1)]
    args = build_parser().parse_args(["--out", str(tmp_path), "--variants", "standard,bigmac", "--no-netns",
                                      "--runs", "1"])
    pytest.importorskip("matplotlib")
    skipped = [{"variant": "standard", "run": 0, "skipped": True}, {"variant": "bigmac", "run": 0, "skipped": True}]
    result = _report(args, str(tmp_path), ["standard", "bigmac"], None, skipped)
    assert [(la["variant"], la["launch"]) for la in result["launches"]] == [("standard", 0), ("bigmac", 0), ("bigmac", 1)]
    assert result["loaded_launches"] == [{"variant": "bigmac", "run": 0}]
