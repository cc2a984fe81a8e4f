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

from megatron.training.testing import run_distributed

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
    from megatron.training.checkpointing import find_latest_checkpoint, read_manifest
    from megatron.training.evaluate_lm import _semmoe_scheduler

    def args(ep=2, tp=1, load=tiny_model.placed2):
        return argparse.Namespace(semmoe_tables=tiny_model.tables2, tensor_model_parallel_size=tp,
                                  expert_model_parallel_size=ep, load=load)

    def manifest(path):
        return read_manifest(find_latest_checkpoint(path), verify=False)

    assert _semmoe_scheduler(args(), manifest(tiny_model.placed2), 2) is not None
    with pytest.raises(ValueError, match="are for 2 devices"):
        _semmoe_scheduler(args(ep=1), manifest(tiny_model.placed2), 1)
    with pytest.raises(ValueError, match="not the placement"):  # tables of another placement
        _semmoe_scheduler(args(load=tiny_model.ckpt), manifest(tiny_model.ckpt), 2)
