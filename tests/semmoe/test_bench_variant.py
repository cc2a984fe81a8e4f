"""The EP benchmark's ``semmoe`` variant: placement + Algorithm 2 over each step's global batch.

With the MoE auxiliary loss off, re-assigning whole samples between data-parallel ranks and
permuting experts leaves the global batch, the model function and so the training trajectory
unchanged: ``semmoe`` reproduces ``standard``'s losses to fp32 summation-order noise (rtol 1e-5;
the gradient all-reduce adds the same per-sample terms in another grouping).
"""

import numpy as np
import pytest
import torch

from tools.spawn import run_distributed

TINY = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=32,
    max_position_embeddings=32, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
    micro_batch_size=2, global_batch_size=8, moe_aux_loss_coeff=0.0,
)  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _megatron_imported():
    """megatron-core takes seconds to import: once in this process, inherited by the forked ranks."""
    import megatron.core.parallel_state  # noqa: F401
    import tools.bench.variant_worker  # noqa: F401
    import tools.semmoe.bench  # noqa: F401


def _run_variants(rank, world, out_dir, variants, profile_samples):
    from tools.bench.schema import WorkerSpec
    from tools.bench.variant_worker import run

    results = {}
    for v in variants:
        spec = WorkerSpec(variant=v, output_dir=f"{out_dir}/{v}", warmup=0, steps=2, seed=3, overrides=dict(TINY),
                          options={"semmoe_profile_samples": profile_samples})  # fmt: skip
        results[v] = run(spec).to_dict()
    return results


def test_semmoe_variant_keeps_the_training_trajectory(tmp_path):
    per_rank = run_distributed(_run_variants, 2, str(tmp_path), ["standard", "semmoe"], 32, timeout_s=300)
    for r in per_rank:
        std, sem = r["standard"], r["semmoe"]
        np.testing.assert_allclose(sem["extra"]["lm_loss"], std["extra"]["lm_loss"], rtol=1e-5)
        info = sem["extra"]["semmoe"]
        assert info["profile_requests"] == 32 and info["profile_tokens"] == 32 * TINY["seq_length"]
        assert 0.0 < info["predicted_dp_lar_on_profile"] <= 1.0
        assert len(sem["extra"]["semmoe_schedule_s"]) == 2 and "semmoe" not in std["extra"]
        assert all(b > 0 for b in sem["a2a_bytes_dispatch"])
        assert sem["tokens"] == std["tokens"]


def test_schedule_gives_each_rank_its_share_in_micro_batches():
    """Algorithm 2 over a global batch of 2 ranks x 2 micro-batches x 2 samples: every sample is
    kept once, each rank gets 4, and rows (tokens, labels, ...) move together. Layouts it cannot
    schedule and a training split too short to hold back profile samples are refused."""
    per_rank = run_distributed(_schedule_once, 2)
    seen = []
    for r, (micro, errors) in enumerate(per_rank):
        assert "needs TP=1, PP=1 and EP = the number of ranks (got TP=1, PP=1, EP=1, 2 ranks)" in errors[0]
        assert "the validation split has 10 samples, fewer than the 16 to profile on" in errors[1]
        assert len(micro) == 2 and all(m["tokens"].shape == (2, 5) for m in micro)
        for m in micro:
            assert torch.equal(m["labels"], m["tokens"] + 1000) and torch.equal(m["mask"], m["tokens"] % 2 == 0)
            assert m["dataset_id"].dtype == torch.int16 and torch.equal(m["dataset_id"].long(), m["tokens"][:, 0])
            seen += m["tokens"][:, 0].tolist()
    assert sorted(seen) == list(range(8))


def _schedule_once(rank, world):
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from tools.semmoe.bench import SemMoEBench
    from moe_variants.semmoe.scheduling import DPRequestScheduler
    from moe_variants.semmoe.tables import Tables

    errors = []
    for ep, samples in ((1, 100), (2, 10)):
        sizes = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=ep)
        try:
            SemMoEBench(SimpleNamespace(parallel=SimpleNamespace(**sizes)), None, None, list(range(samples)), 16)
        except ValueError as e:
            errors.append(str(e))
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    bench = SemMoEBench.__new__(SemMoEBench)  # only the scheduling half: no model, no dataset
    bench.world, bench.rank, bench.dp_group = 2, rank, parallel_state.get_data_parallel_group()
    vocab = 20
    # token t predicts device t % 2 with confidence 1, so a sample's first token decides
    tables = Tables("t", 2, np.array([[0, 1]], dtype=np.int32), token2device=np.array([np.arange(vocab) % 2],
                    dtype=np.int16), token2device_conf=np.ones((1, vocab), dtype=np.float32),
                    seq2device=np.zeros((1, 4), dtype=np.int16), seq2device_conf=np.zeros((1, 4), dtype=np.float32))  # fmt: skip
    bench.scheduler = DPRequestScheduler(tables)
    # global sample s = micro j, rank r, row i -> s = 4 j + 2 r + i; its tokens are [s, s, s, s, s]
    micro = []
    for j in range(2):
        ids = torch.tensor([4 * j + 2 * rank + i for i in range(2)])
        tokens = ids[:, None].repeat(1, 5)
        micro.append({"tokens": tokens, "labels": tokens + 1000, "mask": tokens % 2 == 0,  # bool, int16: not in gloo
                      "dataset_id": ids.to(torch.int16)})
    return list(bench.schedule(iter(micro), 2)), errors


def test_bench_cli_accepts_combined_variant_names():
    from tools.bench.cli import _variants, build_parser

    args = build_parser().parse_args(["--variants", "standard,semmoe,semmoe+bigmac,semmoe+farskip"])
    assert _variants(args) == ["standard", "semmoe", "semmoe+bigmac", "semmoe+farskip"]
    for bad in ("semmoe+", "+bigmac", "semmoe++bigmac"):
        with pytest.raises(ValueError, match="bad variant name"):
            _variants(build_parser().parse_args(["--variants", bad]))
