"""Sem-MoE Algorithm 2 in the lm-eval path: ``evaluate_lm --semmoe-tables`` assigns requests to
data-parallel ranks by the tables of the checkpoint's placement, without changing any score.

Tolerance: the scheduled run batches other requests together than round-robin, which changes
GEMM shapes and so each log-probability by ~1e-6 (tests/eval/test_lm_eval_adapter.py); sums are
compared at 1e-4.
"""

import argparse

import numpy as np
import pytest

try:
    import lm_eval  # noqa: F401
except ImportError:
    pytest.skip('lm-eval is not importable (pip install -e ".[eval]")', allow_module_level=True)

from tools.spawn import run_distributed

CONTEXTS = ["the king rode to the castle", "gold and silver at the market", "seven songs", "a storm at sea " * 3,
            "the doctor and the fever", "winter", "peace council army war", "bread wine and music"]


def _run(rank, world, ckpt, tables_path):
    from lm_eval.api.instance import Instance

    from megatron.training.lm_eval_adapter import MegatronCheckpointLM
    from moe_variants.semmoe.scheduling import request_scheduler, schedule_requests
    from moe_variants.semmoe.tables import load_tables

    seen = {}
    scheduler = None
    if tables_path:
        tables = load_tables(tables_path)
        inner = request_scheduler(tables)

        def scheduler(token_lists):
            seen["ranks"] = inner(token_lists)
            seen["direct"] = schedule_requests([np.asarray(t) for t in token_lists], tables)
            return seen["ranks"]

    lm = MegatronCheckpointLM.from_checkpoint(ckpt, expert_model_parallel_size=2, batch_size=2,
                                              request_scheduler=scheduler)
    reqs = [Instance("loglikelihood", {}, (c, " and the river"), i) for i, c in enumerate(CONTEXTS)]
    scores = lm.loglikelihood(reqs)
    out = {"scores": [s for s, _ in scores], "assigned": lm._ranks.assigned}
    if seen:
        out["ranks"] = [int(r) for r in seen["ranks"]]
        out["direct"] = [int(r) for r in seen["direct"]]
    return out


def test_algorithm_2_assigns_requests_and_keeps_scores(tiny_model):
    base = run_distributed(_run, 2, tiny_model.placed2, None, timeout_s=300)[0]
    got = run_distributed(_run, 2, tiny_model.placed2, tiny_model.tables2, timeout_s=300)
    assert got[0] == got[1]
    g = got[0]
    assert g["ranks"] == g["direct"]  # the adapter hands every request to Algorithm 2, in arrival order
    assert g["assigned"] == np.bincount(g["ranks"], minlength=2).tolist()
    assert sum(g["assigned"]) == len(CONTEXTS) and min(g["assigned"]) > 0  # the rotating mask balances
    assert g["scores"] == pytest.approx(base["scores"], abs=1e-4)


def test_tables_must_fit_the_layout_and_the_checkpoint(tiny_model):
    from megatron.components.checkpointing import find_latest_checkpoint, read_manifest
    from moe_variants import registry

    def args(ep=2, tp=1, load=tiny_model.placed2):
        return argparse.Namespace(semmoe_tables=tiny_model.tables2, tensor_model_parallel_size=tp,
                                  expert_model_parallel_size=ep, load=load)

    def manifest(path):
        return read_manifest(find_latest_checkpoint(path), verify=False)

    assert registry.request_scheduler(args(), manifest(tiny_model.placed2), 2) is not None
    with pytest.raises(ValueError, match="are for 2 devices"):
        registry.request_scheduler(args(ep=1), manifest(tiny_model.placed2), 1)
    with pytest.raises(ValueError, match="not the placement"):  # tables of another placement
        registry.request_scheduler(args(load=tiny_model.ckpt), manifest(tiny_model.ckpt), 2)


# ------------------------------------------------------------------ local activation rate in lm-eval


def _lar_run(rank, world, ckpt, tables_path, prompts, continuation):
    """loglikelihood of ``prompts`` (token lists, as text) + ``continuation`` (and, unscheduled, a
    few generations) at EP=2 with evaluate_lm's LAR counter installed; the scheduler's input is
    recorded."""
    from lm_eval.api.instance import Instance

    from megatron.training.evaluate_lm import _moe_traffic, lar_counter
    from moe_variants.common.moe_layer import reset_comm_counters
    from megatron.training.lm_eval_adapter import MegatronCheckpointLM
    from moe_variants.semmoe.scheduling import request_scheduler
    from moe_variants.semmoe.tables import load_tables

    seen = {}
    scheduler = None
    if tables_path:
        inner = request_scheduler(load_tables(tables_path))

        def scheduler(token_lists):
            seen.setdefault("tokens", []).extend([list(t) for t in token_lists])
            return inner(token_lists)

    lm = MegatronCheckpointLM.from_checkpoint(ckpt, expert_model_parallel_size=2, batch_size=3,
                                              request_scheduler=scheduler)
    reset_comm_counters(lm.model)
    counter, why = lar_counter(lm)
    assert why is None
    contexts = [lm.tok_decode(p) for p in prompts]
    reqs = [Instance("loglikelihood", {}, (c, continuation), i) for i, c in enumerate(contexts)]
    gen = []
    with counter:
        scores = lm.loglikelihood(reqs)
        if not tables_path:  # generation forwards (KV-cache prefill and one-token steps) are counted too
            gen = lm.generate_until([Instance("generate_until", {}, (c, {"until": ["zzz"], "max_gen_toks": n}), i)
                                     for i, (c, n) in enumerate(zip(contexts[:3], [2, 5, 3]))])
    moe = _moe_traffic(lm, inner if tables_path else None)
    moe.update(counter.summary())
    return {"scores": [s for s, _ in scores], "gen": gen, "moe": moe, "tokens": seen.get("tokens"),
            "continuation": lm.tok_encode(continuation), "lengths": [len(lm.tok_encode(c)) for c in contexts]}


def test_lar_counted_in_lm_eval_equals_the_tables_prediction(tiny_model):
    """The local activation rate evaluate_lm reports, counted from the routers in the EP=2 forward
    of the placed checkpoint with Algorithm 2, equals ``evaluate``'s attention-DP prediction from
    the tables and the EP=1 profile of the same prompts, exactly (integer counts; routing does not
    depend on the batching). Padding and lockstep dummies are not counted, but every remote row the
    routers chose over all forwarded tokens is one the dispatchers sent (exact). Scores: as above."""
    from moe_variants.semmoe.metrics import evaluate
    from moe_variants.semmoe.profile import load_profile
    from moe_variants.semmoe.tables import load_tables

    profile = load_profile(tiny_model.profile_path)
    offsets = profile.request_offsets  # the prompts as profiled (truncated to the 64-token context)
    profiled = [profile.token_ids[offsets[r]:offsets[r + 1]].tolist() for r in range(profile.num_requests)]
    got = run_distributed(_lar_run, 2, tiny_model.placed2, tiny_model.tables2, profiled, " the", timeout_s=300)
    base = run_distributed(_lar_run, 2, tiny_model.placed2, None, profiled, " the", timeout_s=300)
    assert got[0]["moe"] == got[1]["moe"] and base[0]["moe"] == base[1]["moe"]
    g, b = got[0], base[0]
    assert len(g["continuation"]) == 1  # the model reads exactly each prompt's tokens
    assert g["tokens"] == profiled  # the requests Algorithm 2 saw are the profiled ones, in order
    predicted = evaluate(load_tables(tiny_model.tables2), profile, "dp", 32, 4, 0)
    k_times_layers = 2 * 2
    assert g["moe"]["activations"] == sum(g["lengths"]) * k_times_layers  # no padding, no dummies
    for run in (g, b):  # hidden 32, fp32
        assert run["moe"]["remote_rows_all_tokens"] * 32 * 4 == run["moe"]["dispatch_bytes_off_rank"]
    assert sum(g["moe"]["requests_per_rank"]) == len(profiled)
    assert sum(b["moe"]["requests_per_rank"]) == len(profiled) + 3
    assert g["moe"]["activations"] == predicted.total_activations
    assert g["moe"]["activations"] - g["moe"]["local_activations"] == predicted.remote_activations
    assert g["moe"]["lar"] == pytest.approx(predicted.lar, abs=1e-12)
    assert g["moe"]["request_scheduling"] == "semmoe-algorithm-2" and b["moe"]["request_scheduling"] == "round-robin"
    assert 0 < b["moe"]["lar"] < 1 and len(b["gen"]) == 3
    assert b["moe"]["activations"] > sum(b["lengths"]) * k_times_layers  # + the generation forwards
    assert g["scores"] == pytest.approx(b["scores"], abs=1e-4)


# ------------------------------------------------------------------------ the CLI refuses bad tables


def _one_layer_tables(src, dst):
    import dataclasses

    from moe_variants.semmoe.tables import load_tables, save_tables

    t = load_tables(src)
    cut = {f: getattr(t, f)[:1] for f in ("expert2device", "token2device", "token2device_conf", "seq2device",
                                          "seq2device_conf")}
    save_tables(dataclasses.replace(t, **cut), dst)


@pytest.mark.parametrize("case", ["layers", "devices", "placement", "no_schedule"])
def test_mismatched_tables_are_a_one_line_error(case, tiny_model, tmp_path, capsys, monkeypatch):
    """``evaluate_lm --semmoe-tables`` with tables that do not fit the model or the run: exit 2, one
    line naming the flag, nothing written, before the model loads or a task is read."""
    from megatron.training.evaluate_lm import main
    from moe_variants.semmoe.methods import place
    from moe_variants.semmoe.profile import load_profile
    from moe_variants.semmoe.tables import save_tables

    ckpt, tables, world = tiny_model.placed2, tiny_model.tables2, "2"
    if case == "layers":
        tables = str(tmp_path / "one_layer")
        _one_layer_tables(tiny_model.tables2, tables)
    elif case == "devices":
        world = "1"
    elif case == "placement":
        ckpt = tiny_model.ckpt  # unplaced: only contiguous tables fit
    elif case == "no_schedule":
        ckpt, tables = tiny_model.ckpt, str(tmp_path / "contiguous2")
        save_tables(place("contiguous", load_profile(tiny_model.profile_path), 2), tables)
    monkeypatch.setenv("WORLD_SIZE", world)
    out = tmp_path / "r.json"
    code = main(["--load", ckpt, "--tasks", "no_such_task", "--output", str(out), "--semmoe-tables", tables,
                 "--expert-model-parallel-size", world])
    err = capsys.readouterr().err.strip().splitlines()
    expect = {"layers": "tables for 1 MoE layers x 8 experts, the model of --load has 2 x 8",
              "devices": "are for 2 devices: run with 2 ranks", "placement": "are not the placement of --load",
              "no_schedule": "carry no token table"}[case]
    assert code == 2 and len(err) == 1 and err[0].startswith("evaluate_lm: error: --semmoe-tables") and expect in err[0], err
    assert not out.exists()


def test_evaluate_lm_refuses_tables_with_tensor_parallelism():
    """evaluate_lm hosts request schedulers only: Sem-MoE's tables at TP > 1 (Algorithm 3, a change
    of the served model) are refused through the registry, before a model loads; the server takes them."""
    import argparse

    import pytest

    from moe_variants import registry

    args = argparse.Namespace(semmoe_tables="tables", tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="--semmoe-tables: evaluate_lm schedules requests by Algorithm 2"):
        registry.check_runtime(args, registry.Application.EVALUATE_LM)
    registry.check_runtime(args, registry.Application.SERVE)
    registry.check_runtime(argparse.Namespace(semmoe_tables="tables", tensor_model_parallel_size=1),
                           registry.Application.EVALUATE_LM)
