"""The EP benchmark's peers (tools/bench/peers): refusals, the GPU peers' upstream configuration, and
the GPU byte counter's bookkeeping (exact: integer byte counts from split sizes)."""

import os
import subprocess
import sys

import pytest
import torch

from tools import repo_root
from tools.bench import peers
from tools.bench.cli import main as bench_main

SCRIPT = os.path.join(repo_root(), "scripts", "bench_ep.py")


@pytest.mark.parametrize("variant", ["mcore-latent", "mcore-ep-overlap"])
def test_gpu_peers_refuse_on_cpu_naming_what_is_missing(variant, capsys):
    """On a CPU-only machine: without --device cuda the error says to add it; with it, that there is
    no CUDA. Either way one line, status 2, before any launch."""
    assert bench_main(["--variants", f"standard,{variant}", "--no-netns"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("bench_ep.py: error: --variants " + variant)
    assert "runs on GPUs only" in err and "--device cuda" in err
    if not torch.cuda.is_available():
        assert bench_main(["--variants", variant, "--no-netns", "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "needs CUDA GPUs" in err and "torch.cuda.is_available() is False" in err


def test_gpu_peer_refusal_names_transformer_engine_and_gpu_count(monkeypatch):
    """With CUDA present (simulated), the next things named are TE, one GPU per rank, and EP > 1."""
    from tools.bench.peers import mcore

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    have = {"transformer_engine": False}
    monkeypatch.setattr(peers, "have_module", lambda name: have.get(name, True))
    assert "Transformer Engine" in mcore.refusal("mcore-latent", "cuda", 1)
    have["transformer_engine"] = True
    assert mcore.refusal("mcore-latent", "cuda", 1) is None
    assert "one GPU per rank, 1 visible" in mcore.refusal("mcore-latent", "cuda", 2)
    assert "--ranks >= 2" in mcore.refusal("mcore-ep-overlap", "cuda", 1)


def test_peers_run_alone_and_deepspeed_needs_the_cpu():
    assert "cannot be combined" in peers.refusal("deepspeed-moe+bigmac", "cpu", 2)
    assert peers.refusal("bigmac+farskip", "cpu", 2) is None
    assert peers.refusal("standard", "cuda", 2) is None
    from tools.bench.peers import deepspeed_moe

    reason = deepspeed_moe.refusal("deepspeed-moe", "cuda", 2)
    if peers.have_module("deepspeed"):
        assert "runs on the CPU" in reason
        assert deepspeed_moe.refusal("deepspeed-moe", "cpu", 2) is None
    else:
        assert "pip install -e '.[deepspeed]'" in reason


def test_cuda_runs_keep_nccl_on_the_shaped_link():
    from tools.bench.cli import NCCL_SHAPED_ENV, _worker_env, build_parser

    args = build_parser().parse_args(["--variants", "standard", "--device", "cuda"])
    assert _worker_env(args, shaped=True) == NCCL_SHAPED_ENV and NCCL_SHAPED_ENV["NCCL_SOCKET_IFNAME"] == "veth0"
    assert _worker_env(args, shaped=False) == {}
    assert _worker_env(build_parser().parse_args(["--variants", "standard"]), shaped=True) == {}


def test_a_peer_without_all_to_all_times_cannot_probe_the_link(monkeypatch, capsys):
    """The upstream peers count bytes only, so the rate search refuses to probe them (checked
    before any launch; the GPU refusal is bypassed here to reach it on a CPU machine)."""
    from tools.bench import netns

    monkeypatch.setattr(peers, "refusal", lambda *a: None)
    monkeypatch.setattr(netns, "open_network", lambda *a, **k: pytest.fail("no network should be opened"))
    assert not peers.get("mcore-latent").measures_a2a_time and peers.get("deepspeed-moe").measures_a2a_time
    assert bench_main(["--variants", "standard,mcore-latent", "--device", "cuda", "--target-comm-fraction", "0.4",
                       "--probe-variant", "mcore-latent"]) == 2  # fmt: skip
    assert "--probe-variant mcore-latent: its all-to-all times are not measured" in capsys.readouterr().err


def test_peer_names_are_bench_variants():
    from tools.bench.variant_worker import RUNTIME_VARIANTS, variant_overrides

    for name in ("deepspeed-moe", "mcore-latent", "mcore-ep-overlap"):
        assert name in RUNTIME_VARIANTS and variant_overrides(name) == {}


def test_mcore_latent_takes_the_bigmac_presets_shape():
    from moe_variants import registry
    from moe_variants.config import ModelConfig
    from tools.bench.peers.mcore import peer_config_overrides

    model = ModelConfig.from_flat(dict(hidden_size=128, num_experts=8, moe_ffn_hidden_size=128))
    got = peer_config_overrides("mcore-latent", model)
    bigmac = ModelConfig.from_flat({**model.flat(), **registry.bench_presets()["bigmac"]})
    section = registry.get("bigmac").section(bigmac)
    assert got == {"moe_latent_size": section.latent_size(128), "moe_ffn_hidden_size": section.expert_ffn(bigmac)}
    assert got["moe_latent_size"] < 128 and got["moe_ffn_hidden_size"] > 128
    assert peer_config_overrides("mcore-ep-overlap", model) == {
        "overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}


def test_torch_level_counter_books_off_rank_rows_by_kind(monkeypatch):
    """2 ranks, this one rank 0: rows for rank 1 leave it. Forward 2-D calls alternate dispatch and
    combine; grad mode off is backward; 1-D is metadata."""
    import torch.distributed as dist

    from tools.bench.peers.mcore import TorchAllToAllCounter

    original = dist.all_to_all_single
    counter = TorchAllToAllCounter()
    try:
        assert dist.all_to_all_single is not original
        hidden = torch.zeros(10, 8)  # 4 bytes x 8 per row
        counter.record(hidden, [3, 7], 2, 0)  # dispatch: 7 rows off-rank
        counter.record(torch.zeros(10), [3, 7], 2, 0)  # probabilities: metadata
        counter.record(hidden, [6, 4], 2, 0)  # combine: 4 rows
        with torch.no_grad():
            counter.record(hidden, None, 2, 0)  # backward, equal splits: 5 rows
        totals = counter.step_totals()
        assert totals["bytes_dispatch"] == 7 * 32 and totals["bytes_combine"] == 4 * 32
        assert totals["bytes_meta"] == 7 * 4 and totals["bytes_backward"] == 5 * 32
        assert totals["time_fwd_s"] == 0 and counter.step_totals()["bytes_dispatch"] == 0
    finally:
        counter.remove()
    assert dist.all_to_all_single is original


def _observed(rank, world):
    import torch.distributed as dist

    from megatron.common import collectives

    seen = []
    remove = collectives.observe_all_to_all_single(lambda t, splits, group: seen.append((tuple(t.shape), splits)))
    out = torch.empty(4)
    splits = [3, 1] if rank == 0 else [1, 3]  # 3 rows stay, 1 goes to the other rank
    collectives.all_to_all_single(out, torch.full((4,), float(rank)), splits, splits)
    dist.all_to_all_single(out, torch.full((4,), float(rank)))  # as megatron-core's own dispatcher calls it
    remove()
    dist.all_to_all_single(out, torch.full((4,), float(rank)))  # no longer observed
    return seen, out.tolist()


def test_observer_sees_the_projects_and_third_party_all_to_alls():
    from tools.spawn import run_distributed

    (seen0, out0), (seen1, _) = run_distributed(_observed, 2)
    assert seen0 == [((4,), [3, 1]), ((4,), None)] and seen1 == [((4,), [1, 3]), ((4,), None)]
    assert out0 == [0.0, 0.0, 1.0, 1.0]  # the collective still ran


def _build_upstream(rank, world):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron.components.parallel import initialize_parallel
    from moe_variants.builder import build_model
    from moe_variants.common.moe_layer import ProjectMoELayer
    from moe_variants.config import ParallelConfig
    from tests.helpers import VOCAB, tiny_model_config

    cfg = tiny_model_config()
    pgc = initialize_parallel(ParallelConfig(), seed=1)
    ours = build_model(cfg, ParallelConfig(), vocab_size=VOCAB, pg_collection=pgc)
    upstream = build_model(cfg, ParallelConfig(), vocab_size=VOCAB, pg_collection=pgc, upstream_moe=True,
                           config_overrides={"moe_router_topk": 1, "moe_router_pre_softmax": True})
    try:
        build_model(cfg, ParallelConfig(), vocab_size=VOCAB, pg_collection=pgc, config_overrides={"no_such": 1})
        error = None
    except ValueError as e:
        error = str(e)
    layers = [m for m in upstream.modules() if isinstance(m, MoELayer)]
    return ([type(m).__name__ for m in ours.modules() if isinstance(m, ProjectMoELayer)],
            [type(m) is MoELayer for m in layers], upstream.config.moe_router_topk, error)


def test_build_model_can_build_megatron_cores_own_moe_layer():
    from tools.spawn import run_distributed

    ours, upstream_is_plain, topk, error = run_distributed(_build_upstream, 1)[0]
    assert len(ours) == 2 and upstream_is_plain == [True, True]
    assert topk == 1 and "no_such" in error


@pytest.mark.slow
def test_gpu_peer_refusal_from_the_command_line():
    proc = subprocess.run([sys.executable, SCRIPT, "--variants", "mcore-ep-overlap", "--no-netns"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "GPUs only" in proc.stderr
