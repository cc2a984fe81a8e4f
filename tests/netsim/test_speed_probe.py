"""``python -m tools.profile.speed_probe``: the summary's statistics, a short probe's JSON, and bad
flags as one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools import repo_root
from tools.profile.speed_probe import SCHEMA, WORKLOADS, probe, summarize


def test_summary_is_median_range_and_spread_per_workload():
    samples = [{"gemm_s": 1.0, "copy_s": 2.0, "python_s": 3.0, "steal_fraction": 0.0},
               {"gemm_s": 3.0, "copy_s": 2.0, "python_s": 3.0},
               {"gemm_s": 2.0, "copy_s": 2.0, "python_s": 6.0, "steal_fraction": 0.1}]
    s = summarize(samples)
    assert s["gemm_s"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3, "spread": 1.0}
    assert s["copy_s"]["spread"] == 0.0 and s["python_s"]["spread"] == 1.0
    assert s["steal_fraction"]["n"] == 2  # a sample without the reading is left out


def test_a_short_probe_times_every_workload_at_each_sample():
    lines = []
    result = probe(minutes=0.01, every_s=0.2, reps=1, threads=1, report=lines.append)
    assert result["schema"] == SCHEMA and len(result["samples"]) == len(lines) >= 1
    assert all(row[key] > 0 for row in result["samples"] for key in WORKLOADS)
    assert set(WORKLOADS) <= set(result["summary"])
    json.dumps(result)


@pytest.mark.parametrize("flags,message", [
    (["--minutes", "0"], "argument --minutes: expected a positive number, got 0"),
    (["--reps", "-1"], "argument --reps"),
])
def test_bad_flags_are_one_line(tmp_path, flags, message):
    out = subprocess.run([sys.executable, "-m", "tools.profile.speed_probe", *flags, "--out", str(tmp_path / "x.json")],
                         cwd=repo_root(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "x.json").exists()
