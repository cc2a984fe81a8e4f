"""bench_ep's --runs wiring without processes: the launches are replaced by synthetic rank results,
the load samples by injected ones. Exact by hand (1e-12: float arithmetic)."""

import json

import pytest

from tools.bench import cli, discipline
from tools.bench.aggregate import merge_runs, over_runs_stats, variant_stats
from tools.bench.schema import RankResult

STEP = {"standard": 2.0, "bigmac": 1.6}
DRIFT = [1.0, 1.5, 0.8]  # the machine's speed in each run: paired speedups do not see it


def _rank(rank, variant, run, steps=2):
    f = DRIFT[run]
    # rank 0 enters each dispatch 0.3 s before rank 1; both leave together: 0.2 s transfer
    spans = [["dispatch", 0.0 if rank == 0 else 0.3, 0.5], ["combine", 1.0, 1.2]]
    a2a = 0.7 if rank == 0 else 0.4
    return RankResult(rank=rank, world_size=2, variant=variant, step_time_s=[STEP[variant] * f] * steps,
                      fwd_time_s=[0.1] * steps, bwd_time_s=[0.1] * steps, a2a_time_s=[a2a] * steps,
                      exposed_comm_s=[a2a] * steps, a2a_bytes_dispatch=[10] * steps, a2a_bytes_combine=[10] * steps,
                      tokens=[100] * steps, peak_rss_mb=50.0 + run, extra={"a2a_spans": [spans] * steps, "device": "cpu"})


def _quiet(avg=0.1):
    return {"loadavg_1_5_15": [avg, avg, avg], "other_cpus": 0.0, "other_share": 0.0, "window_s": 0.5}


def test_parser_defaults_and_flags():
    args = cli.build_parser().parse_args(["--variants", "synthetic"])
    assert (args.runs, args.load_threshold, args.strict, args.repeats) == (3, 1.3, False, 10)
    args = cli.build_parser().parse_args(["--runs", "5", "--strict", "--load-threshold", "0.5"])
    assert (args.runs, args.load_threshold, args.strict) == (5, 0.5, True)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--runs", "0"])


def test_runs_rotate_aggregate_and_mark_loaded_runs(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run(net, variant, args, overrides, work_dir, tag, budget, warmup, steps, trace=False):
        run = int(tag.split("-")[0][3:])
        calls.append((run, variant))
        return [_rank(r, variant, run, steps) for r in range(2)]

    # samples: before the first launch, then after each launch (also the next one's before-sample): the
    # sample after the 4th launch (run 1's standard) is loaded, so are that launch and the next
    samples = iter([_quiet(), _quiet(), _quiet(), _quiet(), _quiet(5.0), _quiet(), _quiet()])
    monkeypatch.setattr(cli, "_run_variant", fake_run)
    monkeypatch.setattr(discipline, "machine_load", lambda: next(samples))
    out = tmp_path / "out.json"
    args = cli.build_parser().parse_args(["--variants", "standard,bigmac", "--no-netns", "--warmup", "0",
                                          "--steps", "2", "--json", str(out)])
    assert cli._benchmark(args, ["python", "scripts/bench_ep.py"], str(tmp_path), cli.Budget(100)) == 0
    assert calls == [(0, "standard"), (0, "bigmac"), (1, "bigmac"), (1, "standard"), (2, "standard"), (2, "bigmac")]
    data = json.loads(out.read_text())
    assert data["schema"] == "bench_ep/2" and data["config"]["runs"] == 3
    assert [r["order"] for r in data["runs"]] == [["standard", "bigmac"], ["bigmac", "standard"], ["standard", "bigmac"]]
    assert [r["load"]["standard"]["loaded"] for r in data["runs"]] == [False, True, True]
    assert not any(r["load"]["bigmac"]["loaded"] for r in data["runs"])
    assert len(data["per_rank"]["bigmac"]) == 3 and len(data["per_rank"]["bigmac"][0]) == 2
    speedup = data["over_runs"]["bigmac"]["step_time_speedup"]
    assert (speedup["median"], speedup["ci_low"], speedup["ci_high"]) == pytest.approx((1.25, 1.25, 1.25), abs=1e-12)
    step = data["over_runs"]["standard"]["step_time_s"]
    assert step["values"] == pytest.approx([2.0, 3.0, 1.6], abs=1e-12) and step["median"] == pytest.approx(2.0)
    assert (step["ci_low"], step["ci_high"]) == pytest.approx((1.6, 3.0), abs=1e-12)  # 3 runs: the range
    # pooled over 3 runs x 2 ranks x 2 steps
    assert data["variants"]["standard"]["step_time_s"]["n"] == 12
    # transfer 0.4 s on both ranks, skew 0.3 s on rank 0 only; run 0 of standard: step 2 s
    assert data["runs"][0]["variants"]["standard"]["transfer_fraction"] == pytest.approx(0.2, abs=1e-12)
    assert data["runs"][0]["variants"]["standard"]["skew_fraction"] == pytest.approx(0.075, abs=1e-12)
    table = capsys.readouterr().out
    assert "standard*" in table and "* standard: run(s) 2, 3 taken on a loaded machine" in table
    assert "medians over 3 runs" in table and "xfer %" in table


def test_strict_refuses_a_loaded_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "_run_variant", lambda *a, **k: pytest.fail("no launch on a loaded machine"))
    monkeypatch.setattr(discipline, "machine_load", lambda: _quiet(9.0))
    args = cli.build_parser().parse_args(["--variants", "standard", "--no-netns", "--strict"])
    with pytest.raises(discipline.LoadRefused, match="--strict"):
        cli._benchmark(args, [], str(tmp_path), cli.Budget(100))


def test_merge_runs_pools_steps_and_over_runs_pairs_by_run():
    runs = [[_rank(r, "bigmac", run) for r in range(2)] for run in range(3)]
    merged = merge_runs(runs)
    assert [m.rank for m in merged] == [0, 1]
    assert merged[0].step_time_s == pytest.approx([1.6, 1.6, 2.4, 2.4, 1.28, 1.28], abs=1e-12)
    assert len(merged[0].extra["a2a_spans"]) == 6 and merged[0].extra["device"] == "cpu"
    assert merged[1].peak_rss_mb == 52.0
    per_run = [{"a": variant_stats([_rank(r, "standard", run) for r in range(2)]),
                "b": variant_stats([_rank(r, "bigmac", run) for r in range(2)])} for run in range(3)]
    over = over_runs_stats(per_run, "a")
    assert over["b"]["step_time_speedup"]["values"] == pytest.approx([1.25] * 3, abs=1e-12)
    assert over["a"]["comm_fraction"]["values"] == pytest.approx([0.275, 0.275 / 1.5, 0.275 / 0.8], abs=1e-12)
