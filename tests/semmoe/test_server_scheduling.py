"""Sem-MoE Algorithm 2 in the server: ``serve --semmoe-tables DIR`` assigns each request to a
data-parallel rank by the tables (in arrival order, the rotating mask balancing them) instead of
round-robin, and the same greedy tokens come out. Both servers also report the local activation
rate (LAR) of the tokens they served.

Requests are sent one at a time, so each is forwarded alone on its rank (the other rank runs the
engine's dummy forwards): the tokens are compared exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.serving.conftest import REPO, Server, get_metrics, post

MAX_NEW = 8
NUM_PROMPTS = 8


def _served_lar(ckpt, tmp_path, prompts, extra) -> tuple:
    """Prefill every prompt (one token out) on a 2-rank server with ``--routing-stats``; returns the
    served local activation rate and the server's ready info."""
    srv = Server(ckpt, tmp_path, nproc=2, extra=[*extra, "--routing-stats"])
    try:
        for ids in prompts:
            status, body = post(srv.url, "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0})
            assert status == 200, body
        metrics = get_metrics(srv.url)
    finally:
        srv.stop()
    return metrics["moe_serve_local_activation_rate"], srv.info


def _prompt_ids(tiny_model) -> list:
    from megatron.components.tokenizer import DEFAULT_TOKENIZER_MODEL, build_tokenizer

    tok = build_tokenizer("HuggingFaceTokenizer", DEFAULT_TOKENIZER_MODEL)
    with open(tiny_model.prompts) as f:
        texts = [json.loads(line)["text"] for line in f][:NUM_PROMPTS]
    return [tok.tokenize(t)[:40] for t in texts]  # the tiny model's context is 64 tokens


def _post_with_headers(url, body):
    import urllib.request

    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status, json.loads(resp.read()), dict(resp.headers.items())


def _serve(ckpt, tmp_path, prompts, extra=(), routing=True):
    srv = Server(ckpt, tmp_path, nproc=2, extra=["--expert-model-parallel-size", "2",
                                                 *(["--routing-stats"] if routing else []), *extra])
    try:
        out, ranks = [], []
        for ids in prompts:
            status, body, headers = _post_with_headers(srv.url, {"prompt": ids, "max_tokens": MAX_NEW,
                                                                 "temperature": 0, "return_token_ids": True})
            assert status == 200, body
            out.append(body["choices"][0]["token_ids"])
            ranks.append(headers.get("x-dp-rank"))
        srv.info["dp_ranks"] = ranks
        return out, srv.info, get_metrics(srv.url)
    finally:
        srv.stop()


@pytest.mark.slow
def test_algorithm_2_in_the_server_keeps_tokens(tiny_model, tmp_path):
    from moe_variants.semmoe.scheduling import schedule_requests
    from moe_variants.semmoe.tables import load_tables

    prompts = _prompt_ids(tiny_model)
    base, base_info, base_m = _serve(tiny_model.placed2, tmp_path, prompts)
    got, info, m = _serve(tiny_model.placed2, tmp_path, prompts, ["--semmoe-tables", tiny_model.tables2])
    assert base_info["request_scheduler"] == "round-robin" and info["request_scheduler"] == "semmoe-algorithm-2"
    assert got == base

    def assigned(metrics):
        return [int(metrics[f'moe_serve_requests_assigned_total{{rank="{r}"}}']) for r in range(2)]

    schedule = schedule_requests([np.asarray(p) for p in prompts], load_tables(tiny_model.tables2))
    expected = np.bincount(schedule, minlength=2).tolist()
    assert assigned(base_m) == [NUM_PROMPTS // 2] * 2
    assert assigned(m) == expected
    # each response names the engine that served it (x-dp-rank): round-robin, and Algorithm 2's choice
    assert base_info["dp_ranks"] == [str(i % 2) for i in range(NUM_PROMPTS)]
    assert info["dp_ranks"] == [str(r) for r in schedule]
    assert abs(expected[0] - expected[1]) <= 2  # the rotating mask: at most one per round of 2

    for metrics in (base_m, m):
        tokens = sum(metrics[f'moe_serve_tokens_forwarded_total{{rank="{r}"}}'] for r in range(2))
        routed = sum(metrics[f'moe_serve_routed_activations_total{{rank="{r}"}}'] for r in range(2))
        local = sum(metrics[f'moe_serve_local_activations_total{{rank="{r}"}}'] for r in range(2))
        assert routed == tokens * 2 * 2  # every real token, top-2, 2 MoE layers; pads and dummies not
        assert 0 < local < routed
        assert metrics["moe_serve_local_activation_rate"] == pytest.approx(local / routed)


def test_tables_of_another_layout_are_refused(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "megatron.inference.serve", "--load", tiny_model.placed2,
                           "--semmoe-tables", tiny_model.tables2, "--port", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert "are for 2 devices" in lines[-1] and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_bench_serve_compares_placements(tiny_model, tmp_path):
    """bench_serve --semmoe-tables: standard (contiguous, round-robin), eplb and affinity-eplb
    (placed) and semmoe (placed + Algorithm 2) served one after another; each reports its LAR and
    load imbalance."""
    from moe_variants.semmoe.methods import place
    from moe_variants.semmoe.profile import load_profile
    from moe_variants.semmoe.tables import save_tables

    tables = tmp_path / "tables"
    tables.mkdir()
    for method in ("eplb", "affinity-eplb"):
        save_tables(place(method, load_profile(tiny_model.profile_path), 2, seed=0), str(tables / method))
    subprocess.run(["cp", "-r", tiny_model.tables2, str(tables / "semmoe")], check=True)
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, "scripts/bench_serve.py", "--load", tiny_model.ckpt, "--semmoe-tables",
                           str(tables), "--variants", "standard,eplb,affinity-eplb,semmoe", "--no-netns",
                           "--ranks", "2", "--prompts", tiny_model.prompts, "--input-len", "24", "--output-len", "4",
                           "--request-rates", "inf", "--num-requests", "6", "--warmup-requests", "0", "--runs", "1",
                           "--json", str(out), "--no-plots", "--work-dir", str(tmp_path / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["config"]["checkpoints"]["standard"] == tiny_model.ckpt
    assert data["config"]["checkpoints"]["semmoe"].endswith("placed-semmoe/ckpt")
    assert data["config"]["checkpoints"]["affinity-eplb"].endswith("placed-affinity-eplb/ckpt")
    for name, scheduler in (("standard", "round-robin"), ("eplb", "round-robin"), ("affinity-eplb", "round-robin"),
                            ("semmoe", "semmoe-algorithm-2")):
        v = data["variants"][name]
        assert v["request_scheduler"] == scheduler and 0 < v["lar"] < 1 and v["load_imbalance"]["max"] >= 1
        assert v["routed_activations"] == v["tokens_forwarded"] * 2 * 2
    assert "LAR" in proc.stdout


@pytest.mark.slow
def test_algorithm_3_in_the_server_keeps_tokens_and_reaches_the_predicted_lar(tiny_model, tmp_path):
    """Attention tensor-parallel serving (TP = EP = 2 on the same two ranks) with ``--semmoe-tables``
    re-batches every MoE layer's tokens by Algorithm 3 (moe_variants/semmoe/attention_tp.py): the
    greedy tokens equal the plain TP=2 server's and the attention-DP server's (exact); on prefill
    of every prompt of the profile, the served local activation rate is within 0.02 of the
    solver's prediction (``metrics.evaluate`` in ``tp`` mode, the figure ``lar --profile`` prints)
    and at least 1.4x the 0.5 of a contiguous placement without re-batching."""
    from moe_variants.semmoe.metrics import evaluate
    from moe_variants.semmoe.profile import load_profile
    from moe_variants.semmoe.tables import load_tables

    tp = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    prompts = _prompt_ids(tiny_model)
    plain, info, _ = _serve(tiny_model.placed2, tmp_path, prompts, tp[:2], routing=False)
    alg3, info3, _ = _serve(tiny_model.placed2, tmp_path, prompts, [*tp[:2], "--semmoe-tables", tiny_model.tables2])
    base, _, _ = _serve(tiny_model.placed2, tmp_path, prompts)
    assert info3["token_scheduler"] == "semmoe-algorithm-3" and info["token_scheduler"] is None
    assert alg3 == plain == base

    from megatron.components.tokenizer import DEFAULT_TOKENIZER_MODEL, build_tokenizer

    tok = build_tokenizer("HuggingFaceTokenizer", DEFAULT_TOKENIZER_MODEL)
    with open(tiny_model.prompts) as f:
        every = [tok.tokenize(json.loads(line)["text"])[:63] for line in f]  # the profile's prompts, context 64
    served, _ = _served_lar(tiny_model.placed2, tmp_path, every, [*tp, "--semmoe-tables", tiny_model.tables2])
    predicted = evaluate(load_tables(tiny_model.tables2), load_profile(tiny_model.profile_path), "tp", None, 2, 0).lar
    assert abs(served - predicted) <= 0.02, (served, predicted)
    assert served >= 1.4 * 0.5


@pytest.mark.slow
def test_unscheduled_tables_serve_algorithm_3_layout_on_contiguous_slices(tiny_model, tmp_path):
    """The fair attention-TP baseline: contiguous tables (no token table) at TP = EP = 2 run
    Algorithm 3's layout with each rank's contiguous slice (the sequence-parallel split), so every
    token is routed once; the served LAR is the tables' ``tp`` prediction (about 1/2), and at TP = 1
    the same tables are refused (Algorithm 2 needs a token table)."""
    from moe_variants.semmoe.methods import place
    from moe_variants.semmoe.metrics import evaluate
    from moe_variants.semmoe.profile import load_profile
    from moe_variants.semmoe.tables import save_tables

    profile = load_profile(tiny_model.profile_path)
    tables = place("contiguous", profile, 2)
    save_tables(tables, tmp_path / "contiguous2")
    prompts = _prompt_ids(tiny_model)
    served, info = _served_lar(tiny_model.ckpt, tmp_path, prompts,
                               ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                                "--semmoe-tables", str(tmp_path / "contiguous2")])
    assert info["token_scheduler"] == "semmoe-algorithm-3"
    predicted = evaluate(tables, profile, "tp", None, 2, 0).lar
    assert abs(served - predicted) <= 0.05 and abs(served - 0.5) <= 0.1, (served, predicted)
    import argparse

    from megatron.components.loading import find_checkpoint
    from moe_variants.semmoe.variant import SemMoE

    _, manifest = find_checkpoint(tiny_model.ckpt)
    args = argparse.Namespace(semmoe_tables=str(tmp_path / "contiguous2"), load=tiny_model.ckpt,
                              tensor_model_parallel_size=1, expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="carry no token table"):
        SemMoE()._tables(args, manifest, 2)
    args.tensor_model_parallel_size = 2
    assert SemMoE()._tables(args, manifest, 2).method == "contiguous"
