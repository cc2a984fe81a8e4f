"""bench_serve's --runs wiring, the transfer/skew split of phases and the medians over runs, without
processes: the servers are replaced by a fake returning hand-made phases and step spans, the load
samples by injected ones. Exact by hand (1e-12: float arithmetic)."""

import json
import os

import pytest

from tools.bench import discipline
from tools.serve_bench import analysis, cli
from tools.serve_bench.options import build_parser

DURATION = {"standard": 2.0, "farskip": 1.0}  # per phase; farskip twice as fast
DRIFT = [1.0, 1.5, 0.8]  # the machine's speed in each run: paired speedups do not see it


def _metrics(**per_rank):
    return {f'{analysis.RANK_COUNTERS[k]}{{rank="{r}"}}': float(v) for k, vs in per_rank.items() for r, v in enumerate(vs)}


ZERO = _metrics(tokens=[0, 0], busy_s=[0, 0], a2a_bytes=[0, 0], a2a_s=[0, 0], exposed_s=[0, 0], steps=[0, 0],
                dummy_forwards=[0, 0])
AFTER = _metrics(tokens=[40, 40], busy_s=[1.0, 1.0], a2a_bytes=[800, 800], a2a_s=[0.3, 0.2], exposed_s=[0.1, 0.1],
                 steps=[4, 4], dummy_forwards=[0, 0])


class FakeServer:
    calls = []

    def __init__(self, net, args, ckpt, preset, run_dir, budget, printer, label, placement=None):
        self.label, self.run_index = label, int(run_dir.rsplit("-run", 1)[1])
        self.run_dir, self.last_result = run_dir, None
        self.windows = []

    def __enter__(self):
        FakeServer.calls.append((self.run_index, self.label))
        os.makedirs(os.path.join(self.run_dir, "a2a_spans"), exist_ok=True)
        return self

    def __exit__(self, *exc):
        return None

    def run(self, phases, what):
        if what != "load":
            return {}
        out = {}
        for k, name in enumerate(phases):
            t0 = 100.0 * (k + 1)
            self.windows.append(t0)
            duration = DURATION[self.label] * DRIFT[self.run_index]
            requests = [{"ttft_s": 0.1 * (i + 1), "e2e_s": 0.5 * (i + 1), "output_tokens": 5, "prompt_tokens": 8,
                         "ok": True, "max_tokens": 5, "sent": 0.1 * i} for i in range(4)]
            out[name] = {"name": name, "duration_s": duration, "requests": requests, "metrics_before": ZERO,
                         "metrics_after": AFTER, "clock_start": t0, "clock_end": t0 + 10.0}
        self.last_result = os.path.join(self.run_dir, "client1-result.json")  # as the load client writes it
        with open(self.last_result, "w") as f:
            json.dump({"url": "fake", "phases": list(out.values())}, f)
        return out

    def spans(self):
        # one engine step per phase: rank 0 enters its dispatch 0.1 s before rank 1, both leave at
        # 0.3 s: 0.2 s transfer on both ranks, 0.1 s skew on rank 0; one step outside every window
        lines = [[], []]
        for t0 in self.windows + [1000.0]:
            lines[0].append({"t": t0 + 1.0, "spans": [["dispatch", t0 + 1.0, t0 + 1.3]]})
            lines[1].append({"t": t0 + 1.0, "spans": [["dispatch", t0 + 1.1, t0 + 1.3]]})
        for r, steps in enumerate(lines):  # as serve --a2a-spans writes them
            with open(os.path.join(self.run_dir, "a2a_spans", f"a2a_spans_rank{r}.jsonl"), "w") as f:
                f.writelines(json.dumps(step) + "\n" for step in steps)
        return lines


def _quiet(avg=0.1):
    return {"loadavg_1_5_15": [avg, avg, avg], "other_cpus": 0.0, "other_share": 0.0, "window_s": 0.5}


def test_parser_defaults():
    args = build_parser().parse_args([])
    assert (args.runs, args.load_threshold, args.strict, args.num_requests) == (3, 1.3, False, None)
    assert cli.DEFAULT_NUM_REQUESTS == 100  # a p99 needs 100 samples
    assert build_parser().parse_args(["--runs", "2", "--strict"]).runs == 2


def test_serve_runs_rotate_split_and_aggregate(tmp_path, monkeypatch, capsys):
    FakeServer.calls = []
    samples = iter([_quiet()] * 4 + [_quiet(9.0)] + [_quiet()] * 2)  # after the 4th launch (run 2 standard): loaded
    monkeypatch.setattr(discipline, "machine_load", lambda: next(samples))
    monkeypatch.setattr(cli, "Server", FakeServer)
    monkeypatch.setattr(cli, "place", lambda *a: {})
    monkeypatch.setattr(cli, "tokenizer_and_context", lambda ckpt: (None, 128))
    monkeypatch.setattr(cli, "phase_requests_for", lambda args, tok, ctx: {
        "phases": {"warmup": [], "rate-1": [], "rate-inf": []}, "probes": [], "info": {}})
    out = tmp_path / "out.json"
    args = build_parser().parse_args(["--load", "CKPT", "--variants", "standard,farskip", "--no-netns",
                                      "--input-len", "8", "--no-plots", "--json", str(out)])
    args.serve_ep = 2
    assert cli._benchmark(args, ["python", "scripts/bench_serve.py"], str(tmp_path), cli.Budget(100),
                          cli.Printer()) == 0
    assert FakeServer.calls == [(0, "standard"), (0, "farskip"), (1, "farskip"), (1, "standard"), (2, "standard"),
                                (2, "farskip")]
    data = json.loads(out.read_text())
    assert data["schema"] == "bench_serve/2" and data["config"]["runs"] == 3
    assert [r["load"]["standard"]["loaded"] for r in data["runs"]] == [False, True, True]
    rate = data["variants"]["farskip"]["rates"]["1"]
    assert rate["num_requests"] == 12 and rate["ttft_s"]["n"] == 12  # pooled over the runs
    tput = rate["over_runs"]["output_tokens_per_s"]
    assert tput["values"] == pytest.approx([20 / 1.0, 20 / 1.5, 20 / 0.8], abs=1e-12)
    assert (tput["ci_low"], tput["ci_high"]) == pytest.approx((20 / 1.5, 20 / 0.8), abs=1e-12)
    speedup = data["ratios"]["farskip"]["rates"]["1"]["over_runs"]["throughput_speedup"]
    assert (speedup["median"], speedup["ci_low"], speedup["ci_high"]) == pytest.approx((2.0, 2.0, 2.0), abs=1e-12)
    # mean over ranks: transfer 0.2 s, skew 0.05 s per phase and run, of 1 s busy
    assert rate["transfer_s"] == pytest.approx(0.6, abs=1e-12) and rate["skew_s"] == pytest.approx(0.15, abs=1e-12)
    assert rate["transfer_fraction"] == pytest.approx(0.2, abs=1e-12)
    assert rate["over_runs"]["skew_fraction"]["median"] == pytest.approx(0.05, abs=1e-12)
    assert data["runs"][1]["variants"]["farskip"]["inf"]["transfer_fraction"] == pytest.approx(0.2, abs=1e-12)
    assert len(data["requests"]["standard"]["rate-inf"]) == 3  # one list per run
    table = capsys.readouterr().out
    assert "standard*" in table and "run(s) 2, 3 taken on a loaded machine" in table
    assert "~" in table and "p99 100" in table and "medians over 3 runs" in table


def _fake_benchmark(tmp_path, monkeypatch, out, *extra):
    monkeypatch.setattr(discipline, "machine_load", lambda: _quiet())
    monkeypatch.setattr(cli, "Server", FakeServer)
    monkeypatch.setattr(cli, "place", lambda *a: {})
    monkeypatch.setattr(cli, "tokenizer_and_context", lambda ckpt: (None, 128))
    monkeypatch.setattr(cli, "phase_requests_for", lambda args, tok, ctx: {
        "phases": {"warmup": [], "rate-1": [], "rate-inf": []}, "probes": [], "info": {}})
    args = build_parser().parse_args(["--load", "CKPT", "--variants", "standard,farskip", "--no-netns",
                                      "--input-len", "8", "--no-plots", "--json", str(out), *extra])
    args.serve_ep = 2
    return cli._benchmark(args, ["python", "scripts/bench_serve.py"], str(tmp_path / "work"), cli.Budget(100),
                          cli.Printer())


def test_resume_reuses_the_finished_runs_and_serves_the_rest(tmp_path, monkeypatch, capsys):
    FakeServer.calls = []
    assert _fake_benchmark(tmp_path, monkeypatch, tmp_path / "first.json") == 0
    first = json.loads((tmp_path / "first.json").read_text())
    os.remove(tmp_path / "work" / "serve-farskip-run1" / "done.json")  # as if cut off in that run
    FakeServer.calls = []
    capsys.readouterr()
    assert _fake_benchmark(tmp_path, monkeypatch, tmp_path / "again.json", "--resume") == 0
    assert FakeServer.calls == [(1, "farskip")]
    assert capsys.readouterr().out.count("reused from") == 5
    again = json.loads((tmp_path / "again.json").read_text())
    for key in ("variants", "ratios", "requests"):
        assert again[key] == first[key], key  # the reused runs read back exactly as measured
    assert again["runs"][0]["load"] == first["runs"][0]["load"]
    # other settings than the finished runs': refused in one line, naming the setting
    with pytest.raises(cli.UserError, match=r"num_requests=None, this command has 7"):
        _fake_benchmark(tmp_path, monkeypatch, tmp_path / "other.json", "--resume", "--num-requests", "7")
    with pytest.raises(cli.UserError, match=r"max_requests=.*, this command has 3"):  # any served setting counts
        _fake_benchmark(tmp_path, monkeypatch, tmp_path / "other.json", "--resume", "--max-requests", "3")
    # analysis-only settings (SLOs) and a longer time limit do not stop the reuse
    FakeServer.calls = []
    assert _fake_benchmark(tmp_path, monkeypatch, tmp_path / "slo.json", "--resume", "--slo-ttft", "2",
                           "--timeout-s", "99") == 0 and FakeServer.calls == []


def test_phase_split_takes_the_steps_inside_the_window():
    lines = [[{"t": 1.0, "spans": [["dispatch", 1.0, 1.5]]}, {"t": 5.0, "spans": [["dispatch", 5.0, 5.5]]}],
             [{"t": 1.0, "spans": [["dispatch", 1.2, 1.5]]}, {"t": 5.0, "spans": [["dispatch", 5.4, 5.5]]}]]
    split = analysis.phase_split(lines, 0.0, 2.0)
    assert split["steps"] == 1 and split["transfer_s"] == pytest.approx([0.3, 0.3], abs=1e-12)
    assert split["skew_s"] == pytest.approx([0.2, 0.0], abs=1e-12)
    both = analysis.phase_split(lines, 0.0, 9.0)
    assert both["transfer_s"] == pytest.approx([0.4, 0.4], abs=1e-12) and both["skew_s"][0] == pytest.approx(0.6)
    assert analysis.phase_split([lines[0], lines[1][:1]], 0.0, 9.0) is None  # different step counts
    assert analysis.split_summary([split, None], 1.0)["transfer_s"] is None
    assert analysis.split_summary([split, both], 2.0) == pytest.approx(
        {"transfer_s": 0.7, "skew_s": 0.4, "transfer_fraction": 0.35, "skew_fraction": 0.2}, abs=1e-12)


def test_prefill_amdahl_uses_the_transfer_share_and_medians_over_runs():
    def stats(tput, share, transfer):
        one = lambda v: {"median": v, "min": v, "max": v, "n": 1}  # noqa: E731
        return {"prefill_tokens_per_s": one(tput), "forward_tokens_per_s": one(2 * tput), "a2a_fraction": one(share),
                "exposed_fraction": one(share), "transfer_fraction": one(transfer), "skew_fraction": one(share - transfer),
                "a2a_bytes_per_token": 100.0}

    r = analysis.prefill_ratios({"standard": stats(100.0, 0.6, 0.5), "bigmac": stats(180.0, 0.3, 0.2)})
    assert r["bigmac"]["amdahl_basis"] == "transfer" and r["bigmac"]["amdahl_bound"] == pytest.approx(2.0)
    assert r["bigmac"]["baseline_a2a_fraction"] == 0.6 and r["bigmac"]["baseline_transfer_fraction"] == 0.5
    no_split = {k: v for k, v in stats(100.0, 0.6, 0.5).items() if k not in ("transfer_fraction", "skew_fraction")}
    r = analysis.prefill_ratios({"standard": no_split})
    assert r["standard"]["amdahl_basis"] == "in flight" and r["standard"]["amdahl_bound"] == pytest.approx(2.5)
    per_run = [{"standard": stats(100.0 * f, 0.6, 0.5), "bigmac": stats(150.0 * f, 0.3, 0.2)} for f in DRIFT]
    over = analysis.prefill_over_runs(per_run, "standard")
    assert over["bigmac"]["throughput_speedup"]["values"] == pytest.approx([1.5] * 3, abs=1e-12)
    assert over["standard"]["prefill_tokens_per_s"]["median"] == pytest.approx(100.0, abs=1e-12)
    assert over["bigmac"]["skew_fraction"]["median"] == pytest.approx(0.1, abs=1e-12)
