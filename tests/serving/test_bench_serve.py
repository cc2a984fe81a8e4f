"""``scripts/bench_serve.py`` end to end on the tiny serving checkpoint: two server ranks (EP=2) over
loopback, the load client streaming requests, the JSON's shape and its statistics checked against
the raw per-request records it carries (exact: the same numbers recomputed) and against token
counts known in advance (exact: every request generates ``max_tokens`` tokens with ``ignore_eos``,
so the engine forwards each prompt plus ``max_tokens - 1`` generated tokens). Bad flags give one
line and write nothing. The network-namespace run skips without root. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from megatron.common.process import pid_alive
from tools import repo_root
from tools.bench import netns
from tools.serve_bench.loadgen import RequestTiming, percentile, summarize

SCRIPT = os.path.join(repo_root(), "scripts", "bench_serve.py")


def _run(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=repo_root())


def _in_process(argv, capsys):
    from tools.serve_bench.cli import main

    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv,flag", [
    (["--no-netns", "--target-comm-fraction", "0.5", "--input-len", "8"], "--target-comm-fraction"),
    (["--no-netns"], "--prompts"),
    (["--prompts", "MISSING.json", "--no-netns"], "--prompts"),
    (["--variants", "standard,nosuch", "--input-len", "8", "--no-netns"], "nosuch"),
    (["--variants", "semmoe", "--input-len", "8", "--no-netns"], "--load"),
    (["--variants", "eplb+farskip", "--input-len", "8", "--no-netns"], "do not combine"),
    (["--semmoe-tables", "MISSING", "--input-len", "8", "--no-netns"], "--semmoe-tables"),
    (["--request-rates", "0", "--input-len", "8", "--no-netns"], "--request-rates"),
    (["--request-rates", "1,1", "--input-len", "8", "--no-netns"], "--request-rates"),
    (["--num-requests", "3", "--duration", "5", "--input-len", "8", "--no-netns"], "--duration"),
    (["--config", "MISSING.yaml", "--input-len", "8", "--no-netns"], "--config"),
    (["--load", "MISSING", "--input-len", "8", "--no-netns"], "--load"),
    (["--mode", "prefill", "--input-len", "600", "--no-netns"], "--prefill-tokens"),
    (["--load-threshold", "-1", "--input-len", "8", "--no-netns"], "--load-threshold"),
    (["--resume", "--target-comm-fraction", "0.5", "--input-len", "8"], "--resume needs a fixed link"),
    # the checkpoints are trained on --ranks first: 16 = 8 x 2 ranks fits, not 8 x 4
    (["--config", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "bench_bigmac_top8_cpu.yaml"), "--ranks", "4", "--input-len", "8", "--no-netns"],
     "--global-batch-size 16 is not divisible by --micro-batch-size 8 x data-parallel size 4"),
])
def test_bad_flags_give_one_line_and_write_nothing(argv, flag, tmp_path, capsys):
    argv = [a.replace("MISSING", str(tmp_path / "missing")) for a in argv]
    out = tmp_path / "out"
    code, err = _in_process([*argv, "--json", out / "r.json", "--work-dir", out / "work"], capsys)
    assert code == 2 and flag in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_resume_needs_a_work_dir(tmp_path, capsys):
    code, err = _in_process(["--resume", "--input-len", "8", "--no-netns", "--json", tmp_path / "r.json"], capsys)
    assert code == 2 and "--resume needs --work-dir" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r.json").exists()


def test_a_variant_that_changes_parameters_needs_its_own_checkpoint(serve_ckpts, tmp_path):
    out = tmp_path / "out"
    proc = _run("--load", serve_ckpts["standard"], "--variants", "standard,bigmac", "--input-len", 8, "--no-netns",
                "--json", out / "r.json", "--work-dir", out / "work")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "--variants bigmac: bigmac changes the parameters" in err[0], proc.stderr
    assert "--config" in err[0] and not out.exists()


def _check_distributions(stats: dict, requests: list) -> None:
    ok = [r for r in requests if r["ok"]]
    timings = [RequestTiming(r["ttft_s"], r["e2e_s"], r["output_tokens"], r["ok"]) for r in requests]
    for key, values in (("ttft_s", [t.ttft_s for t in timings if t.ok]), ("e2e_s", [t.e2e_s for t in timings if t.ok]),
                        ("tpot_s", [t.tpot_s for t in timings if t.ok and t.tpot_s is not None])):
        assert set(stats[key]) == {"p50", "p90", "p99", "n"} and stats[key]["n"] == len(values)
        assert stats[key]["p50"] <= stats[key]["p90"] <= stats[key]["p99"]
        assert stats[key]["p50"] == percentile(values, 50) and stats[key]["p99"] == percentile(values, 99)
    assert len(ok) == len(requests) == stats["num_requests"] and stats["failed_requests"] == 0


@pytest.mark.slow
def test_loopback_serving_run_writes_the_documented_json(serve_ckpts, tmp_path):
    out = tmp_path / "serve.json"
    proc = _run("--load", serve_ckpts["standard"], "--variants", "standard,farskip", "--no-netns", "--ranks", 2,
                "--input-len", 12, "--output-len", 6, "--request-rates", "4,inf", "--num-requests", 5,
                "--warmup-requests", 2, "--slo-ttft", 5.0, "--slo-tpot", 1.0, "--runs", 1, "--json", out,
                "--timeout-s", 500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "NOT shaped" in proc.stderr and "TTFT p50/p99 ms" in proc.stdout
    assert "~: a percentile from fewer samples" in proc.stdout  # 5 requests per rate: p99 needs 100
    data = json.loads(out.read_text())
    assert data["schema"] == "bench_serve/2" and data["mode"] == "serve" and data["baseline"] == "standard"
    assert data["config"]["runs"] == 1 and len(data["runs"]) == 1 and "loaded" in data["runs"][0]["load"]["standard"]
    assert data["network"]["mode"] == "loopback" and data["tuning"] is None
    assert data["config"]["workload"]["request_rates"] == ["4", "inf"]
    for name in ("standard", "farskip"):
        v = data["variants"][name]
        assert set(v["rates"]) == {"4", "inf"} and 0 < v["lar"] < 1 and v["request_scheduler"] == "round-robin"
        assert v["routed_activations"] % v["tokens_forwarded"] == 0  # every real token, top-k x MoE layers
        assert v["load_imbalance"]["mean"] >= 1
        assert data["ratios"][name]["throughput_speedup"] == pytest.approx(
            v["output_tokens_per_s"] / data["variants"]["standard"]["output_tokens_per_s"])
        pooled = []
        for rate, s in v["rates"].items():
            reqs = data["requests"][name][f"rate-{rate}"][0]  # run 0
            pooled += reqs
            _check_distributions(s, reqs)
            assert s["output_tokens"] == 5 * 6 and s["short_outputs"] == 0  # ignore_eos: exactly max_tokens
            assert {r["dp_rank"] for r in reqs} == {0, 1}  # the streamed x-dp-rank header: round-robin
            assert s["tokens_forwarded"] == sum(r["prompt_tokens"] + r["max_tokens"] - 1 for r in reqs) == 5 * 17
            expected = summarize([RequestTiming(r["ttft_s"], r["e2e_s"], r["output_tokens"]) for r in reqs],
                                 s["duration_s"], slo_ttft_s=5.0, slo_tpot_s=1.0)
            for key in ("output_tokens_per_s", "requests_per_s", "goodput_requests_per_s"):
                assert s[key] == expected[key]
            assert s["a2a_bytes_per_token"] > 0 and 0 < s["a2a_fraction"] <= 1 and 0 <= s["exposed_fraction"] <= 1
            # the servers' step spans split the in-flight time: transfer + skew = the counters' (5%: the
            # counters reach /metrics between scrapes, the spans by the step's start time)
            assert s["transfer_s"] > 0 and s["skew_s"] >= 0
            assert s["transfer_s"] + s["skew_s"] == pytest.approx(s["a2a_time_s"], rel=0.05)
            assert s["exposed_a2a_s_per_output_token"] == pytest.approx(s["exposed_a2a_s"] / s["output_tokens"])
            assert data["ratios"][name]["rates"][rate]["throughput_speedup"] == pytest.approx(
                s["output_tokens_per_s"] / data["variants"]["standard"]["rates"][rate]["output_tokens_per_s"])
        _check_distributions(v, pooled)
        assert v["tokens_forwarded"] == sum(s["tokens_forwarded"] for s in v["rates"].values())
    assert data["variants"]["standard"]["rates"]["inf"]["offered_rate"] is None
    assert data["ratios"]["standard"]["throughput_speedup"] == 1.0
    for suffix in ("latency", "throughput"):
        png = tmp_path / f"serve_{suffix}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_loopback_prefill_run_reports_throughput_share_and_amdahl(serve_ckpts, tmp_path):
    out = tmp_path / "prefill.json"
    proc = _run("--load", serve_ckpts["standard"], "--variants", "standard,farskip-simple", "--no-netns",
                "--mode", "prefill", "--input-len", 16, "--prefill-tokens", 64, "--prefill-batches", 2,
                "--prefill-repeats", 2, "--runs", 2, "--json", out, "--no-plots", "--timeout-s", 500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "prefill" and data["config"]["server"]["max_batch_tokens"] == 64
    assert [r["order"] for r in data["runs"]] == [["standard", "farskip-simple"], ["farskip-simple", "standard"]]
    base = data["variants"]["standard"]
    for name, v in data["variants"].items():
        phases = data["requests"][name]
        assert set(phases) == {"prefill-0", "prefill-1"}  # --prefill-repeats 2
        assert all(len(p) == 2 for p in phases.values())  # --runs 2
        reqs = [r for p in phases.values() for run in p for r in run]
        assert len(reqs) == 2 * 2 * 2 * 2 * (64 // 16) and all(r["output_tokens"] == 1 for r in reqs)
        assert v["prompt_tokens"] == v["tokens_forwarded"] == 16 * len(reqs)  # prompts only: max_tokens 1
        per_repeat = [x["prompt_tokens"] / x["duration_s"] for x in v["repeats"]]
        assert v["prefill_tokens_per_s"]["median"] == pytest.approx(statistics.median(per_repeat))  # 2 runs x 2
        assert v["over_runs"]["prefill_tokens_per_s"]["n"] == 2
        assert [x["forward_tokens_per_s"] for x in v["repeats"]] == \
            [x["tokens_forwarded"] / x["engine_busy_s"] for x in v["repeats"]]
        r = data["ratios"][name]
        f, ft = base["a2a_fraction"]["median"], base["transfer_fraction"]["median"]
        assert r["amdahl_basis"] == "transfer" and 0 < ft <= f + 1e-9  # the bound removes the transfer only
        assert r["amdahl_bound"] == pytest.approx(1 / (1 - ft)) and r["baseline_a2a_fraction"] == f
        assert r["throughput_speedup"] == pytest.approx(
            v["prefill_tokens_per_s"]["median"] / base["prefill_tokens_per_s"]["median"])
    assert not list(tmp_path.glob("*.png"))


ok, why = netns.netns_available() if os.geteuid() == 0 else (False, "not root")


@pytest.mark.slow
@pytest.mark.skipif(not ok, reason=f"network namespaces unavailable: {why}")
def test_netns_run_searches_the_link_rate_and_leaves_no_namespace(serve_ckpts, tmp_path):
    before = set(netns.list_project_namespaces())
    out = tmp_path / "netns.json"
    proc = _run("--load", serve_ckpts["standard"], "--variants", "standard", "--mode", "prefill", "--input-len", 16,
                "--prefill-tokens", 64, "--prefill-batches", 1, "--prefill-repeats", 1, "--target-comm-fraction", 0.3,
                "--link-gbit", 0.05,
                "--max-probes", 2, "--probe-rounds", 1, "--runs", 1, "--json", out, "--no-plots", "--timeout-s", 500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["network"]["mode"] == "netns" and data["network"]["shaped"]
    tuning = data["tuning"]
    assert tuning["probe_variant"] == "standard" and 1 <= len(tuning["probes"]) <= 2
    assert data["network"]["link"]["gbit"] == tuning["gbit"]
    # a namespace of a live process may be another test's (the slow tier runs on several workers); one
    # whose creator has exited is a leftover
    left = set(netns.list_project_namespaces()) - before
    assert not [n for n in left if not pid_alive(int(n.rsplit("-", 3)[1]))], left  # <prefix>-<pid>-<seq>-<role>


@pytest.mark.slow
def test_config_trains_one_checkpoint_per_variant_and_reuses_it(tmp_path):
    """``--config`` without ``--load``: each variant's checkpoint is trained with pretrain_gpt (BigMac's
    has its own parameters, so its served bytes per token are lower at the same sizes), and a second
    run in the same ``--work-dir`` reuses a checkpoint trained with the same settings."""
    work = tmp_path / "work"
    common = ["--config", os.path.join(repo_root(), "examples", "tiny_moe_cpu.yaml"), "--num-layers", 1,
              "--hidden-size", 64, "--set", "bigmac_ratio=0.25", "--train-steps", 2, "--no-netns", "--mode", "prefill",
              "--input-len", 32, "--prefill-tokens", 64, "--prefill-batches", 1, "--prefill-repeats", 1, "--no-plots",
              "--runs", 1, "--work-dir", work, "--timeout-s", 500]
    out = tmp_path / "a.json"
    proc = _run(*common, "--variants", "standard,bigmac", "--json", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    ckpts = data["config"]["checkpoints"]
    assert ckpts == {v: str(work / f"train-{v}" / "ckpt") for v in ("standard", "bigmac")}
    assert data["config"]["model"]["train_steps"] == 2 and data["config"]["workload"]["input_len"] == 32
    # r = 0.25 of the hidden size crosses the link. An idle EP rank's dummy forwards (how many depends
    # on when the 4 requests reach the engine) add their all-to-alls to either side: 0.19 and 0.53 were
    # measured in two runs; a payload still at the full hidden size gives about 1
    assert data["ratios"]["bigmac"]["bytes_ratio"] < 0.75
    proc = _run(*common, "--variants", "bigmac", "--json", tmp_path / "b.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"[bigmac] reusing the checkpoint in {ckpts['bigmac']}" in proc.stdout
    assert "training" not in proc.stdout
