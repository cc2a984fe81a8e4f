"""End to end over loopback: the CLI runs the synthetic worker and writes the documented JSON.

The synthetic worker's byte counters are checked against a hand computation (exact): per layer
and step, a rank sends ``tokens x topk`` rows split evenly over the ranks, so the rows leaving
rank r are ``tokens x topk - split[r]``, each ``hidden x 4`` bytes (fp32).
"""

import csv
import json
import os
import subprocess
import sys

import pytest

from tools.bench.calibration import aggregate_rows, default_sizes, repeats_for
from tools import repo_root
from tools.bench.schema import STEP_FIELDS, RankResult
from tools.bench.synthetic_worker import even_splits

# runs the benchmark command end to end
pytestmark = pytest.mark.slow

SCRIPT = os.path.join(repo_root(), "scripts", "bench_ep.py")
TOKENS, HIDDEN, TOPK, LAYERS = 6, 8, 2, 2


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout)


def test_loopback_synthetic_run_writes_the_documented_json(tmp_path):
    out = tmp_path / "out.json"
    proc = _run(
        "--variants", "synthetic", "--no-netns", "--ranks", "2", "--runs", "2", "--warmup", "1", "--steps", "2",
        "--synthetic-tokens", str(TOKENS), "--synthetic-hidden", str(HIDDEN), "--synthetic-ffn", "16",
        "--synthetic-topk", str(TOPK), "--synthetic-layers", str(LAYERS), "--json", str(out),
        "--timeout-s", "100",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "NOT shaped" in proc.stderr  # the loopback warning
    assert "synthetic" in proc.stdout and "comm %" in proc.stdout
    data = json.loads(out.read_text())
    assert data["schema"] == "bench_ep/2"
    assert set(data) >= {"command", "date", "host", "config", "network", "tuning", "baseline", "variants",
                         "over_runs", "ratios", "runs", "per_rank"}  # fmt: skip
    assert data["network"]["mode"] == "loopback" and data["network"]["shaped"] is False
    assert data["config"]["ranks"] == 2 and data["config"]["steps"] == 2 and data["config"]["runs"] == 2
    assert [set(r["load"]["synthetic"]) >= {"before", "after", "loaded"} for r in data["runs"]] == [True, True]
    stats = data["variants"]["synthetic"]
    for key in (*STEP_FIELDS, "a2a_bytes", "comm_fraction", "exposed_fraction", "tokens_per_s", "peak_rss_mb"):
        assert set(stats[key]) == {"median", "min", "max", "n"}, key
        assert stats[key]["min"] <= stats[key]["median"] <= stats[key]["max"]
    assert stats["step_time_s"]["n"] == 8  # 2 runs x 2 ranks x 2 steps
    assert data["over_runs"]["synthetic"]["step_time_s"]["n"] == 2
    # the synthetic worker records its collectives: in flight = transfer + rank-skew wait
    assert stats["transfer_s"]["n"] == 8 and stats["transfer_fraction"]["max"] <= stats["comm_fraction"]["max"] + 1e-9
    assert data["ratios"]["synthetic"]["step_time_speedup"] == pytest.approx(1.0)
    assert len(data["per_rank"]["synthetic"]) == 2  # per run
    ranks = [RankResult.from_dict(d) for d in data["per_rank"]["synthetic"][1]]
    assert [r.rank for r in ranks] == [0, 1]
    for r in ranks:
        r.validate(2)
        off_rank_rows = TOKENS * TOPK - even_splits(TOKENS * TOPK, 2)[r.rank]
        expected = LAYERS * off_rank_rows * HIDDEN * 4
        assert r.a2a_bytes_dispatch == [expected, expected]
        assert r.a2a_bytes_combine == [expected, expected]
        assert r.a2a_bytes_backward == [2 * expected, 2 * expected]
        assert r.tokens == [TOKENS, TOKENS]
        for step, fwd, bwd in zip(r.step_time_s, r.fwd_time_s, r.bwd_time_s):
            assert fwd + bwd <= step


def test_user_errors_are_one_line_with_status_2(tmp_path):
    proc = _run("--variants", "Bad Name", "--no-netns")
    assert proc.returncode == 2 and "--variants" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = _run("--variants", "synthetic", "--no-netns", "--target-comm-fraction", "0.5")
    assert proc.returncode == 2 and "--target-comm-fraction" in proc.stderr
    proc = _run("--collectives", "--no-netns")
    assert proc.returncode == 2 and "--csv" in proc.stderr
    proc = _run("--variants", "synthetic", "--no-netns", "--config", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "--config" in proc.stderr


def test_the_harness_keeps_the_traceback_of_a_bug(tmp_path, capsys):
    """bench_ep's and bench_serve's skeleton: a ``UserError`` is one line and status 2; a
    ``ValueError`` from inside the run (a bug, e.g. in the aggregation) keeps its traceback."""
    from megatron.common.cli import UserError
    from tools.bench.cli import run_harness

    def bad_input(work_dir):
        raise UserError("--steps must be >= 1, got 0")

    def bug(work_dir):
        raise ValueError("rank results [0] do not cover world size 2")

    assert run_harness("bench_ep.py", "workers", str(tmp_path), "x-", bad_input) == 2
    assert capsys.readouterr().err == "bench_ep.py: error: --steps must be >= 1, got 0\n"
    with pytest.raises(ValueError, match="do not cover world size"):
        run_harness("bench_ep.py", "workers", str(tmp_path), "x-", bug)


def test_loopback_calibration_writes_csv_and_sidecar(tmp_path):
    path = tmp_path / "cal.csv"
    proc = _run("--collectives", "--no-netns", "--csv", str(path), "--calibration-ranks", "2",
                "--sizes", "4096,65536", "--repeats", "2", "--warmup", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(path.open()))
    assert [(r["op"], r["ranks"], r["bytes"]) for r in rows] == [
        ("all_to_all", "2", "4096"), ("all_to_all", "2", "65536"),
        ("all_reduce", "2", "4096"), ("all_reduce", "2", "65536"),
    ]  # fmt: skip
    assert all(float(r["seconds"]) > 0 for r in rows)
    side = json.loads((tmp_path / "cal.json").read_text())
    assert side["repeats"] == 2 and side["networks"][0]["mode"] == "loopback"
    assert side["command"][:4] == ["python", "scripts/bench_ep.py", "--collectives", "--no-netns"]


def test_loopback_calibration_one_way_with_gaps(tmp_path):
    """``--one-way``: only rank 0 sends (uneven splits every rank agrees on, or gloo would fail);
    ``--gap-ms``: the idle time before each call; both recorded in the sidecar."""
    path = tmp_path / "one.csv"
    proc = _run("--collectives", "--no-netns", "--csv", str(path), "--calibration-ranks", "2", "--ops", "all_to_all",
                "--sizes", "4096,65536", "--repeats", "2", "--warmup", "1", "--gap-ms", "1", "--one-way")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(path.open()))
    assert [(r["op"], r["bytes"]) for r in rows] == [("all_to_all", "4096"), ("all_to_all", "65536")]
    side = json.loads((tmp_path / "one.json").read_text())
    assert side["one_way"] is True and side["gap_s"] == pytest.approx(1e-3)
    proc = _run("--collectives", "--no-netns", "--csv", str(tmp_path / "bad.csv"), "--one-way")  # all_reduce too
    assert proc.returncode == 2 and "--one-way" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = _run("--collectives", "--no-netns", "--csv", str(tmp_path / "bad.csv"), "--gap-ms", "-1")
    assert proc.returncode == 2 and "--gap-ms" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad.csv").exists()


def test_calibration_aggregation_by_hand():
    per_rank = [
        {"rows": [{"op": "all_reduce", "bytes": 64, "start": [10.0, 20.0, 30.0], "end": [13.0, 25.0, 32.0]}]},
        {"rows": [{"op": "all_reduce", "bytes": 64, "start": [10.5, 21.0, 30.0], "end": [12.0, 24.0, 32.5]}]},
    ]
    (row,) = aggregate_rows(per_rank)
    # last exit - last entry: 13 - 10.5, 25 - 21, 32.5 - 30 = 2.5, 4, 2.5 -> median 2.5
    assert row == {"op": "all_reduce", "ranks": 2, "bytes": 64, "seconds": 2.5, "min_s": 2.5, "max_s": 4.0,
                   "mean_s": 3.0, "repeats_s": [2.5, 4.0, 2.5]}  # fmt: skip


def test_repeats_rule():
    assert repeats_for(64 << 20, 10) == 10 and repeats_for(1 << 20, 10) == 10
    assert repeats_for(512 << 10, 10) == 20 and repeats_for(4096, 10) == 100


def test_default_sizes_cover_4k_to_64m_log_spaced():
    sizes = default_sizes()
    assert sizes[0] == 4096 and sizes[-1] == 64 << 20 and len(sizes) >= 8
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))


def test_exact_rss_sets_a_fixed_mmap_threshold_for_the_ranks():
    from tools.bench.cli import _worker_env, build_parser

    assert _worker_env(build_parser().parse_args(["--variants", "standard"])) == {}
    env = _worker_env(build_parser().parse_args(["--variants", "standard", "--exact-rss"]))
    assert env == {"MALLOC_MMAP_THRESHOLD_": "1048576"}
