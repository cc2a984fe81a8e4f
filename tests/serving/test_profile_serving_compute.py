"""scripts/profile_serving_compute.py on a tiny checkpoint: engine steps of known shapes are timed,
fitted, and written in the form ``netsim.replay`` reads (no timing asserted, only the shape of the
result and the quantities that do not depend on time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.serving.conftest import REPO


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_profile_writes_what_netsim_replay_reads(serve_ckpts, tmp_path, tp):
    """At TP = EP = 2 (one engine) the TP collectives are counted too: per step the embedding's and
    each layer's attention and shared-expert all-reduces (1 + 2 x 2) of hidden 32 fp32 values per
    token, and one gather of the logits."""
    run = {"schema": "bench_serve/1", "config": {
        "variants": ["standard"], "checkpoints": {"standard": serve_ckpts["standard"]}, "ranks": 2,
        "tensor_model_parallel_size": tp, "expert_model_parallel_size": 2,
        "threads": 1, "model": {"load": serve_ckpts["standard"]},
        "server": {"max_batch_tokens": 128, "max_requests": 8, "kv_cache_gb": 0.02}}}
    bench = tmp_path / "serve.json"
    bench.write_text(json.dumps(run))
    out = tmp_path / "profile.json"
    # one launch of 2 rounds; at TP 1 a precision no measurement meets, so the profile is refused; at
    # TP 2 one every measurement meets (2 rounds give a t-interval of +-12.7 standard errors: on a busy
    # machine wider than 100%), since this test checks the profile's form, not its precision
    limit = "1e-9" if tp == 1 else "1e6"
    proc = subprocess.run([sys.executable, "scripts/profile_serving_compute.py", "--bench-serve", str(bench),
                           "--out", str(out), "--repeats", "2", "--launches", "1", "--precision", limit,
                           "--disturbed", "100"],  # a busy test machine may slow a round: keep both
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if tp == 1:  # refused: one line naming the widest cost, nothing at --out, the measurements kept aside
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]
        assert "wider than --precision" in proc.stderr and not out.exists()
        out = tmp_path / "profile.rejected.json"
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
    prof = json.loads(out.read_text())
    assert prof["schema"] == "serving-compute-profile/1" and prof["ranks"] == 2
    v = prof["variants"]["standard"]
    from netsim.replay import StepProfile

    step = StepProfile.from_dict(v)
    assert step.a2a_calls == 3 * 2  # dispatch, combine and routing metadata of 2 MoE layers
    assert step.a2a_bytes_per_token > 0 and step.dummy_s > 0
    assert step.iteration_s > 0  # the real loop's overhead, measured
    assert step.tp == tp
    from netsim.replay import step_calls

    for layout in (step.layout_decode, step.layout_prefill):  # the compute around each recorded call, in order
        assert len(layout) == len(step_calls(step)) + 1 and sum(layout) == pytest.approx(1.0)
    if tp == 1:
        assert 0 < v["lar"] < 1 and step.tp_allreduces == 0
    else:  # every TP rank routes the same tokens: no LAR; TP collectives counted
        assert v["lar"] is None
        assert (step.tp_allreduces, step.tp_allreduce_bytes_per_token, step.tp_gathers) == (5, 32 * 4, 1)
        assert step.tp_gather_bytes_per_request > 0
    prec = v["precision"]  # the profile's own spread, an interval per cost
    assert (prec["launches"], prec["rounds"]) == (1, 2)
    for cost in ("fixed_s", "dummy_s", "step_smallest_s", "step_largest_s"):
        c = prec["costs"][cost]
        assert 0 < c["low"] <= c["high"] and c["half_width"] >= 0
    assert {r["round"] for r in v["samples"]} == {1, 2}  # the warm-up round is not kept
    kinds = {p["kind"] for p in v["points"]}
    assert kinds == {"prefill", "decode"}
    # tokens as the engine pads them: every prefill shape up to 128 tokens rounds to 64 or 128
    assert {p["tokens"] for p in v["points"] if p["kind"] == "prefill"} <= {64, 128}
    assert {p["tokens"] for p in v["points"] if p["kind"] == "decode"} == {8}


def test_a_layout_it_does_not_profile_is_one_line(tmp_path):
    run = {"config": {"variants": ["standard"], "checkpoints": {"standard": str(tmp_path)}, "ranks": 2,
                      "tensor_model_parallel_size": 2, "expert_model_parallel_size": 1, "server": {}}}
    (tmp_path / "serve.json").write_text(json.dumps(run))
    proc = subprocess.run([sys.executable, "scripts/profile_serving_compute.py", "--bench-serve",
                           str(tmp_path / "serve.json"), "--out", str(tmp_path / "p.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "TP 2 x EP 1" in proc.stderr and not (tmp_path / "p.json").exists()


def test_bad_input_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/profile_serving_compute.py", "--bench-serve",
                           str(tmp_path / "missing.json"), "--out", str(tmp_path / "p.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--bench-serve" in proc.stderr and not (tmp_path / "p.json").exists()
