"""tools/bench/trace_overlap.py (scripts/trace_overlap.py): per-collective in-flight / window /
exposed times from a bench trace."""

import json
import os
import subprocess
import sys

import pytest

from moe_variants.common.comm import TimelineRecorder
from tools.bench.overlap import summarize
from tools.bench.trace_overlap import load_trace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "trace_overlap.py")


def _trace(tmp_path):
    """A step of 100 ms (times in seconds): a dispatch in flight 0-10 ms whose wait starts at 6 ms
    (window 6, exposed 4) with the routing probabilities in flight inside it (1-9 ms, never
    waited: counted once in the direction's time), a combine 20-30 ms never waited on (all hidden), a backward dispatch
    50-70 ms waited on from its launch (window 0, exposed 20)."""
    t = TimelineRecorder()
    ms = 1e-3
    t.add("dispatch", "comm", 0 * ms, 10 * ms)
    t.add("meta", "comm", 1 * ms, 9 * ms)
    t.add("wait dispatch", "wait", 6 * ms, 10.2 * ms)  # wake-up after completion is not exposed
    t.add("combine", "comm", 20 * ms, 30 * ms)
    t.add("wait combine", "wait", 40 * ms, 40 * ms)  # waited after it finished: window 20
    t.add("dispatch", "comm", 42 * ms, 44 * ms)  # another layer's, never waited: window = in flight
    t.add("dispatch bwd", "comm", 50 * ms, 70 * ms)
    t.add("wait dispatch bwd", "wait", 50 * ms, 70 * ms)
    t.add("attention L0", "phases", 1 * ms, 6 * ms)
    t.add("attention L1", "phases", 21 * ms, 24 * ms)
    t.add("farskip step", "step", 0 * ms, 100 * ms)
    path = tmp_path / "trace_farskip_rank0.json"
    path.write_text(json.dumps(t.to_chrome_trace(pid=0)))
    return path


def test_summary_splits_in_flight_into_window_and_exposed(tmp_path):
    s = summarize(load_trace(str(_trace(tmp_path))))
    assert s["step_ms"] == pytest.approx(100.0)
    kinds = s["kinds"]
    assert kinds["dispatch"]["count"] == 2 and kinds["dispatch"]["exposed_count"] == 1
    assert kinds["dispatch"]["in_flight_ms"] == pytest.approx(12.0)
    assert kinds["dispatch"]["window_ms"] == pytest.approx(8.0)
    assert kinds["dispatch"]["exposed_ms"] == pytest.approx(4.0)
    assert kinds["combine"]["exposed_ms"] == 0.0 and kinds["combine"]["window_ms"] == pytest.approx(20.0)
    assert kinds["dispatch bwd"]["window_ms"] == 0.0 and kinds["dispatch bwd"]["exposed_ms"] == pytest.approx(20.0)
    fwd, bwd = s["directions"]["forward"], s["directions"]["backward"]
    assert kinds["meta"]["in_flight_ms"] == pytest.approx(8.0) and kinds["meta"]["exposed_ms"] == 0.0
    assert fwd["in_flight_ms"] == pytest.approx(22.0)  # not 30: the meta flew inside the dispatch
    assert fwd["overlap"] == pytest.approx(1 - 4 / 22)
    assert bwd["overlap"] == pytest.approx(0.0)
    assert s["forward_phases_ms"] == {"attention": pytest.approx(8.0)}


@pytest.mark.slow  # starts processes
def test_cli_prints_table_and_writes_json(tmp_path):
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, SCRIPT, str(_trace(tmp_path)), "--json", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "overlap 81.8%" in proc.stdout and "dispatch bwd" in proc.stdout
    assert len(json.loads(out.read_text())["collectives"]) == 5


@pytest.mark.slow  # starts processes
def test_cli_rejects_a_file_that_is_not_a_trace(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = subprocess.run([sys.executable, SCRIPT, str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "cannot read trace" in proc.stderr


@pytest.mark.slow  # starts processes
def test_cli_rejects_json_that_is_not_a_bench_trace(tmp_path):
    for text in ('[1, 2]', '{"traceEvents": [{"ph": "M", "tid": 1}]}', '{"traceEvents": []}'):
        bad = tmp_path / "other.json"
        bad.write_text(text)
        proc = subprocess.run([sys.executable, SCRIPT, str(bad)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, text
        assert proc.stderr.strip().count("\n") == 0 and "trace_overlap.py: error:" in proc.stderr, proc.stderr
