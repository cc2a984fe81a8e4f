"""A checkpoint placed by affinity-aware EPLB (``tools.semmoe apply``) and served by bench_serve's
placed variant ``affinity-eplb``.

The placed model computes the original's function: fp32 logits at EP = 1 and 2 agree with the
unplaced EP = 1 logits to atol/rtol 1e-5 (the combine sums expert outputs in another order, as in
``test_model_side``); each rank holds exactly the experts the tables give it (bitwise).
"""

import argparse
import os

import numpy as np
import pytest
import torch

from moe_variants.semmoe.methods import place
from moe_variants.semmoe.profile import load_profile
from moe_variants.semmoe.tables import save_tables
from tools import variants as variant_hooks
from tools.spawn import run_distributed

ATOL = RTOL = 1e-5


def _apply(rank, world, ckpt, tables, out):
    from tools.semmoe.apply import apply_placement

    return apply_placement(ckpt, tables, out)


def _logits(rank, world, original, placed, physical_to_logical, tokens):
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants.builder import causal_attention_mask
    from moe_variants.common.moe_layer import moe_layers
    from moe_variants.config import ParallelConfig
    from moe_variants.global_state import gather_global_state_dict, local_weights

    seq = tokens.shape[1]
    pos = torch.arange(seq)[None].expand_as(tokens)
    out = {}
    for ep in (1, 2):
        parallel = ParallelConfig(expert_model_parallel_size=ep)
        pgc = initialize_parallel(parallel, seed=1)
        for name, path in (("original", original), ("placed", placed)) if ep == 1 else (("placed", placed),):
            model, *_ = load_model(path, parallel=parallel, pg_collection=pgc)
            with torch.no_grad():
                out[(name, ep)] = model(tokens, pos, causal_attention_mask(seq))
            if name == "original":
                full = gather_global_state_dict(model, pgc)
        if ep == 2:  # rank r holds the original weights of the experts the tables put on device r
            weights = local_weights(model)  # per-expert names on either expert path
            for l, layer in enumerate(moe_layers(model)):
                for j in range(layer.num_local_experts):
                    logical = int(physical_to_logical[l][layer.local_expert_indices[j]])
                    local = f"decoder.layers.{l}.mlp.experts.local_experts.{j}."
                    owned = {n[len(local):]: w for n, w in weights.items() if n.startswith(local)}
                    assert sorted(owned) == ["linear_fc1.weight", "linear_fc2.weight"]
                    for pname, w in owned.items():
                        key = f"decoder.layers.{l}.mlp.experts.local_experts.{logical}.{pname}"
                        assert torch.equal(w, full[key]), (l, j, pname)
                    out[("owned", l, j)] = logical
    return out


def test_placed_checkpoint_computes_the_same_function(tiny_model, tmp_path):
    tables = place("affinity-eplb", load_profile(tiny_model.profile_path), 2, seed=0)
    p2l = tables.physical_to_logical()
    assert not np.array_equal(p2l, np.tile(np.arange(8), (2, 1)))  # a real permutation to undo
    save_tables(tables, tmp_path / "tables")
    run_distributed(_apply, 1, tiny_model.ckpt, str(tmp_path / "tables"), str(tmp_path / "placed"))
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(3))
    results = run_distributed(_logits, 2, tiny_model.ckpt, str(tmp_path / "placed"), p2l.tolist(), tokens,
                              timeout_s=300)  # fmt: skip
    ref = results[0][("original", 1)]
    for rank, rank_out in enumerate(results):
        for ep in (1, 2):
            torch.testing.assert_close(rank_out[("placed", ep)], ref, atol=ATOL, rtol=RTOL)
        for l in range(2):
            owned = sorted(rank_out[("owned", l, j)] for j in range(4))
            assert owned == np.flatnonzero(tables.expert2device[l] == rank).tolist()


def _serve_args(tables_dir, load, tp=1, ranks=2):
    return argparse.Namespace(semmoe_tables=str(tables_dir), load=load, tensor_model_parallel_size=tp,
                              serve_ep=ranks, ranks=ranks)  # fmt: skip


def test_bench_serve_serves_it_as_a_placed_baseline(tiny_model, tmp_path):
    from megatron.components.checkpointing import find_latest_checkpoint, read_manifest

    assert "affinity-eplb" in variant_hooks.serve_placement_names()
    manifest = read_manifest(find_latest_checkpoint(tiny_model.ckpt), verify=False)
    args = _serve_args(tmp_path, tiny_model.ckpt)
    with pytest.raises(ValueError, match="no affinity-eplb/ tables directory"):
        variant_hooks.check_serve_bench(args, ["standard", "affinity-eplb"], manifest)
    save_tables(place("affinity-eplb", load_profile(tiny_model.profile_path), 2), tmp_path / "affinity-eplb")
    variant_hooks.check_serve_bench(args, ["standard", "affinity-eplb"], manifest)
    with pytest.raises(ValueError, match="on 2 devices; --load has .* --ranks is 4"):
        variant_hooks.check_serve_bench(_serve_args(tmp_path, tiny_model.ckpt, ranks=4), ["affinity-eplb"], manifest)
    path = os.path.abspath(tmp_path / "affinity-eplb")
    served = variant_hooks.serve_placement("affinity-eplb", args)
    assert served.command("CKPT", "OUT") == ["-m", "moe_variants.semmoe", "apply", "--load", "CKPT", "--tables",
                                             path, "--out", "OUT"]  # fmt: skip
    assert served.request_scheduler == "round-robin" and served.server_arguments == ()  # served as EPLB is
    # attention-TP: Algorithm 3's layout on contiguous slices, as the eplb baseline
    at_tp = variant_hooks.serve_placement("affinity-eplb", _serve_args(tmp_path, tiny_model.ckpt, tp=2))
    assert at_tp.server_arguments == ("--semmoe-tables", path) and at_tp.request_scheduler == "round-robin"
