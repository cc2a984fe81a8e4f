"""Model-side Sem-MoE: profiling a checkpoint, applying a placement, measuring LAR in a forward.

All on a tiny 2-layer, 8-expert model (``conftest.tiny_model``) over gloo ranks. Tolerances: the
placed model computes the same function, but the combine sums expert outputs in another order and
experts see other batch compositions, so fp32 logits agree to rounding (atol/rtol 1e-5, about 100
ulps of the O(1) logits), not bitwise; routes and counts are integers and compared exactly.
"""

import json
import os

import numpy as np
import pytest
import torch

from tools.spawn import run_distributed
from tools.semmoe.cli import main
from moe_variants.semmoe.metrics import evaluate
from moe_variants.semmoe.profile import load_profile
from moe_variants.semmoe.tables import Tables, load_tables, save_tables

ATOL = RTOL = 1e-5


def _tokens(seed=0, batch=2, seq=24, vocab=2048):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ profile


def _profile_layouts(rank, world, ckpt, prompts):
    from megatron.core import parallel_state

    from tools.semmoe.model_run import RunOptions, profile_rank

    out = {}
    for name, tp, ep in (("ep2", 1, 2), ("tp2_ep2", 2, 2)):
        opts = RunOptions(load=ckpt, data=prompts, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                          batch_tokens=128)  # fmt: skip
        out[name] = profile_rank(opts)
        parallel_state.destroy_model_parallel()
    return out


def test_profile_is_layout_independent_and_extends_by_embedding(tiny_model):
    """EP=2 (two data-parallel ranks) and TP=2 x EP=2 record exactly the EP=1 routes; tokens never
    seen take their cosine-nearest seen token in the input embedding table."""
    ref = load_profile(tiny_model.profile_path)
    results = run_distributed(_profile_layouts, 2, tiny_model.ckpt, tiny_model.prompts, timeout_s=240)
    assert results[1] == {"ep2": None, "tp2_ep2": None}  # only global rank 0 builds the profile
    for name, prof in results[0].items():
        np.testing.assert_array_equal(prof.token_ids, ref.token_ids, err_msg=name)
        np.testing.assert_array_equal(prof.request_offsets, ref.request_offsets, err_msg=name)
        np.testing.assert_array_equal(prof.routes, ref.routes, err_msg=name)
        for a, b in zip(prof.counts, ref.counts):
            assert (a != b).nnz == 0, name
        np.testing.assert_array_equal(prof.nn_source, ref.nn_source, err_msg=name)
    assert ref.num_layers == 2 and ref.num_experts == 8 and ref.top_k == 2 and ref.meta["hidden_size"] == 32
    # nearest neighbour by brute force over the checkpoint's embedding table
    emb = _embedding(tiny_model.ckpt)[: ref.vocab_size]
    seen = np.flatnonzero(ref.token_freq > 0)
    unseen = np.flatnonzero(ref.token_freq == 0)
    assert len(unseen) > 1000 and ref.meta["vocab_extended"] == len(unseen)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    for t in unseen[:: max(1, len(unseen) // 50)]:
        assert ref.nn_source[t] == seen[np.argmax(unit[seen] @ unit[t])]
    np.testing.assert_array_equal(ref.nn_source[seen], seen)


def _embedding(ckpt):
    def fn(rank, world, path):
        from moe_variants.config import ParallelConfig
        from megatron.components.loading import load_model
        from megatron.components.parallel import initialize_parallel

        pgc = initialize_parallel(ParallelConfig())
        model, *_ = load_model(path, parallel=ParallelConfig(), pg_collection=pgc)
        return model.embedding.word_embeddings.weight.detach().numpy().copy()

    return run_distributed(fn, 1, ckpt)[0]


# -------------------------------------------------------------------------------------- apply


def _apply(rank, world, ckpt, tables, out):
    from tools.semmoe.apply import apply_placement

    return apply_placement(ckpt, tables, out)


def _logits_and_ownership(rank, world, original, placed, physical_to_logical, tokens):
    from moe_variants.config import ParallelConfig
    from moe_variants.global_state import gather_global_state_dict, local_weights
    from megatron.components.loading import load_model
    from moe_variants.builder import causal_attention_mask
    from moe_variants.common.moe_layer import moe_layers
    from megatron.components.parallel import initialize_parallel

    seq = tokens.shape[1]
    pos = torch.arange(seq)[None].expand_as(tokens)
    out = {}
    for ep in (1, 2, 4):
        parallel = ParallelConfig(expert_model_parallel_size=ep)
        pgc = initialize_parallel(parallel, seed=1)
        runs = (("original", original), ("placed", placed)) if ep == 1 else (("placed", placed),)
        for name, path in runs:
            model, *_ = load_model(path, parallel=parallel, pg_collection=pgc)
            with torch.no_grad():
                out[(name, ep)] = model(tokens, pos, causal_attention_mask(seq))
            if name == "original":
                full = gather_global_state_dict(model, pgc)  # EP=1: every expert, no communication
        if ep == 4:  # the tables' D: rank r must own exactly the experts the tables put on device r
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
                    out[("owned", l, rank, j)] = logical
    return out


def test_applied_checkpoint_computes_the_same_function_at_ep_1_2_4(tiny_model, tmp_path):
    """A placement for D=4 (a fixed non-trivial permutation) applied to the checkpoint: logits at
    EP=1, 2 and 4 equal the original's at EP=1 (fp32, ATOL/RTOL; EP=2 == EP=1 for the original
    model is megatron's own EP test's business), and at EP=4 each rank holds, as its
    local experts, the weights of exactly the experts the tables assign to it."""
    rng = np.random.default_rng(0)
    e2d = np.stack([rng.permutation(np.arange(8) // 2) for _ in range(2)])  # [L, N], 2 experts per device
    tables = Tables("test", 4, e2d.astype(np.int32))
    save_tables(tables, tmp_path / "t4")
    p2l = tables.physical_to_logical()
    assert not np.array_equal(p2l, np.tile(np.arange(8), (2, 1)))
    run_distributed(_apply, 1, tiny_model.ckpt, str(tmp_path / "t4"), str(tmp_path / "placed4"))
    tokens = _tokens()
    results = run_distributed(_logits_and_ownership, 4, tiny_model.ckpt, str(tmp_path / "placed4"),
                              p2l.tolist(), tokens, timeout_s=300)  # fmt: skip
    ref = results[0][("original", 1)]
    for rank_out in results:
        torch.testing.assert_close(rank_out[("original", 1)], ref, atol=0, rtol=0)  # same on every rank
        for ep in (1, 2, 4):
            torch.testing.assert_close(rank_out[("placed", ep)], ref, atol=ATOL, rtol=RTOL)
    for l in range(2):
        for r in range(4):
            owned = sorted(results[r][("owned", l, r, j)] for j in range(2))
            assert owned == sorted(np.flatnonzero(e2d[l] == r).tolist())
    # exported placement: expert -> rank per layer, and the record in the manifest
    iter_dir = os.path.join(tmp_path / "placed4", sorted(os.listdir(tmp_path / "placed4"))[0])
    placement = json.load(open(os.path.join(iter_dir, "semmoe_tables", "placement.json")))
    assert placement["expert_to_rank"] == e2d.tolist() and placement["num_devices"] == 4
    manifest = json.load(open(os.path.join(iter_dir, "manifest.json")))
    record = manifest["configs"]["semmoe"]
    assert record["semmoe_tables_map"] == p2l.tolist() and record["semmoe_method"] == "test"


# ---------------------------------------------------------------------------------------- LAR


def _lar_runs(rank, world, fx, contiguous2):
    from megatron.core import parallel_state

    from tools.semmoe.model_run import RunOptions, lar_rank

    out = {}
    for name, ckpt, tables, mode in (
        ("semmoe_dp", fx.placed2, fx.tables2, "dp"),
        ("semmoe_tp", fx.placed2, fx.tables2, "tp"),
        ("contiguous_tp", fx.ckpt, contiguous2, "tp"),
    ):
        opts = RunOptions(load=ckpt, data=fx.prompts, tensor_model_parallel_size=2 if mode == "tp" else 1,
                          expert_model_parallel_size=2, batch_tokens=256)  # fmt: skip
        out[name] = lar_rank(opts, tables, mode)
        parallel_state.destroy_model_parallel()
    return out


def test_measured_lar_equals_tables_prediction(tiny_model, tmp_path):
    """LAR two ways: counting routed tokens in a real EP=2 forward of the placed checkpoint (with
    Algorithm 2 for attention-DP; for attention-TP the served path at TP = EP = 2, Algorithm 3's
    shuffled reduce-scatter of the tensor-parallel attention output, and the contiguous
    sequence-parallel slices for the unscheduled tables) equals ``evaluate``'s prediction from
    the tables and the profile of the same prompts (exact counts), and the remote activations the
    routers chose equal the rows the dispatchers sent."""
    from moe_variants.semmoe.methods import place

    profile = load_profile(tiny_model.profile_path)
    save_tables(place("contiguous", profile, 2), tmp_path / "contiguous2")
    results = run_distributed(_lar_runs, 2, tiny_model, str(tmp_path / "contiguous2"), timeout_s=300)
    assert all(v is None for v in results[1].values())
    tables = {"semmoe": load_tables(tiny_model.tables2), "contiguous": load_tables(tmp_path / "contiguous2")}
    for name, measured in results[0].items():
        method, mode = name.split("_")
        predicted = evaluate(tables[method], profile, mode, 32, 4, 0)
        assert measured["total_activations"] == profile.num_tokens * 2 * 2
        assert measured["remote_activations"] == predicted.remote_activations, name
        for key in ("lar", "lar_p25", "lar_p50", "lar_p75"):
            assert measured[key] == pytest.approx(getattr(predicted, key), abs=1e-12), (name, key)
        assert measured["observed_remote_rows_all_tokens"] == measured["dispatch_rows"], name
    by = results[0]
    assert by["semmoe_tp"]["lar"] > by["contiguous_tp"]["lar"]


def _attention_tp_logits(rank, world, ckpt, tables_path, tokens, num_real):
    from megatron.core import parallel_state

    from megatron.inference.engine import replicate_activations
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants.builder import causal_attention_mask
    from moe_variants.config import ParallelConfig
    from moe_variants.semmoe.attention_tp import install

    seq = tokens.shape[1]
    pos, mask = torch.arange(seq)[None], causal_attention_mask(seq)
    out = []
    for scheduled in (False, True):
        parallel = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2)
        pgc = initialize_parallel(parallel, seed=1)
        model, *_ = load_model(ckpt, parallel=parallel, pg_collection=pgc)
        replicate_activations(model)
        state = install(model, load_tables(tables_path), pgc.tp) if scheduled else None
        if state is not None:
            state.num_real = num_real
        with torch.no_grad():
            logits = model(tokens, pos, mask, runtime_gather_output=True)
        history = [h.clone() for h in state.history] if state is not None else None
        perms = {k: v.clone() for k, v in state.perms.items()} if state is not None else None
        out.append((logits, history, perms))
        parallel_state.destroy_model_parallel()
    return out


def test_algorithm_3_in_the_tensor_parallel_forward_is_exact(tiny_model):
    """Algorithm 3 in the served attention-TP model (TP = EP = 2, activations replicated outside
    the experts; shuffled reduce-scatter of attention's un-reduced output before each MoE layer,
    shuffled all-gather after): the logits equal the same layout's plain forward on both ranks
    (to rounding: the reduction and the combine add in another order), both ranks make the same
    permutations and routed-device history, and the padding beyond ``num_real`` tokens fills the
    free slots without moving a real token off its aligned device."""
    from moe_variants.semmoe.scheduling import align_to_ranks, predict_token_devices

    tokens = _tokens(seed=3, batch=1, seq=30)
    results = run_distributed(_attention_tp_logits, 2, tiny_model.placed2, tiny_model.tables2, tokens, 27)
    for (plain, _, _), (alg3, history, perms) in results:
        torch.testing.assert_close(alg3, plain, atol=ATOL, rtol=RTOL)
        assert len(history) == 2 and all(h.shape == (30,) for h in history)
    (_, h0, p0), (_, h1, p1) = results[0][1], results[1][1]
    assert all(torch.equal(a, b) for a, b in zip(h0, h1)) and all(torch.equal(p0[k], p1[k]) for k in p0)
    tables = load_tables(tiny_model.tables2)
    layer_tables = (tables.token2device, tables.token2device_conf)
    pred, conf = predict_token_devices(tokens[0, :27], 2, *(torch.as_tensor(x[0]) for x in layer_tables))
    slice_of = torch.empty(30, dtype=torch.long)
    slice_of[p0[0]] = torch.arange(30) // 15  # the rank whose slice each token landed in
    assert torch.equal(slice_of[:27], align_to_ranks(pred, conf, 2))


# -------------------------------------------------------------------------------- bad input


def _one_line_error(capsys, rc, *fragments):
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("python -m tools.semmoe: error: ") and err.count("\n") == 1, err
    for f in fragments:
        assert f in err, err


def test_bad_input_is_one_line_and_writes_nothing(tiny_model, tmp_path, capsys):
    ckpt, tables2 = tiny_model.ckpt, tiny_model.tables2
    out = tmp_path / "out"
    rc = main(["apply", "--load", str(tmp_path / "nope"), "--tables", tables2, "--out", str(out)])
    _one_line_error(capsys, rc, "nope")
    # tables for another expert count, and for another number of MoE layers
    save_tables(Tables("x", 2, np.tile(np.arange(4) // 2, (2, 1)).astype(np.int32)), tmp_path / "t_e4")
    rc = main(["apply", "--load", ckpt, "--tables", str(tmp_path / "t_e4"), "--out", str(out)])
    _one_line_error(capsys, rc, "2 MoE layers x 4 experts", "2 x 8")
    save_tables(Tables("x", 2, np.tile(np.arange(8) // 4, (3, 1)).astype(np.int32)), tmp_path / "t_l3")
    rc = main(["apply", "--load", ckpt, "--tables", str(tmp_path / "t_l3"), "--out", str(out)])
    _one_line_error(capsys, rc, "3 MoE layers x 8 experts")
    rc = main(["apply", "--load", ckpt, "--tables", str(tmp_path / "missing"), "--out", str(out)])
    _one_line_error(capsys, rc, "missing")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    # existing outputs are refused and left alone
    out.mkdir()
    (out / "keep").write_text("x")
    rc = main(["apply", "--load", ckpt, "--tables", tables2, "--out", str(out)])
    _one_line_error(capsys, rc, "exists")
    assert [p.name for p in out.iterdir()] == ["keep"]
    existing = tmp_path / "p.npz"
    existing.write_text("old")
    rc = main(["profile", "--load", ckpt, "--data", tiny_model.prompts, "--out", str(existing)])
    _one_line_error(capsys, rc, "exists")
    assert existing.read_text() == "old"
    rc = main(["profile", "--load", str(tmp_path / "nope"), "--data", tiny_model.prompts, "--out",
               str(tmp_path / "p2.npz")])  # fmt: skip
    _one_line_error(capsys, rc, "nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"no_text": 1}\n')
    rc = main(["profile", "--load", ckpt, "--data", str(bad), "--out", str(tmp_path / "p2.npz")])
    _one_line_error(capsys, rc, "bad.jsonl:2")
    rc = main(["profile", "--load", ckpt, "--data", tiny_model.prompts, "--out", str(tmp_path / "p2.npz"),
               "--expert-model-parallel-size", "3"])  # fmt: skip
    _one_line_error(capsys, rc, "--expert-model-parallel-size 3")
    assert not (tmp_path / "p2.npz").exists()
    # the tables' token predictions only hold for the placement they were solved for
    rc = main(["lar", "--load", ckpt, "--tables", tables2, "--data", tiny_model.prompts])
    _one_line_error(capsys, rc, "not the placement of --load")
    rc = main(["lar", "--load", tiny_model.placed2, "--tables", tables2, "--data", tiny_model.prompts,
               "--out", str(existing)])  # fmt: skip
    _one_line_error(capsys, rc, "exists")


@pytest.mark.slow
def test_an_error_found_by_rank_0_alone_is_one_line_at_two_ranks(tiny_model, tmp_path):
    """``lar --profile P`` where P profiled other prompts: rank 0 finds it while reporting, after
    the forward, alone. The command (2 torchrun ranks: the tables' D) prints that one line and
    exits 2; rank 1 does not die first on the lost connection to rank 0 (the only output before)."""
    import subprocess
    import sys

    from moe_variants.semmoe.profile import save_profile

    other = load_profile(tiny_model.profile_path)
    other.meta["request_ids"] = [f"other:{i}" for i in range(other.num_requests)]
    save_profile(other, tmp_path / "other.npz")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "tools.semmoe", "lar", "--load", tiny_model.placed2, "--tables",
                           tiny_model.tables2, "--data", tiny_model.prompts, "--profile", str(tmp_path / "other.npz")],
                          cwd=repo, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines == [f"python -m tools.semmoe: error: --profile {tmp_path / 'other.npz'} lacks 24 of the measured "
                     "prompts (e.g. id 'g0')"], proc.stderr[-3000:]
    assert "Connection closed by peer" not in proc.stderr


def _empty_all_to_all(rank, world):
    import torch.distributed as dist

    from moe_variants.common.comm import CommCounters, all_to_all

    counters = CommCounters()
    # rank 1 sends nothing (no token of its slice chose a remote expert) but receives 3 rows
    x = torch.ones(3, 4) if rank == 0 else torch.ones(0, 4)
    out = all_to_all(dist.group.WORLD, x, [0, 0] if rank == 0 else [3, 0], [0, 3] if rank == 0 else [0, 0],
                     counters=counters, kind="combine")  # fmt: skip
    return tuple(out.shape), counters.bytes_combine


def test_all_to_all_with_an_empty_send_buffer():
    """Regression (seen in ``lar --mode tp`` at EP=4): a rank whose slice routes no token to a
    remote expert sends a [0, H] buffer; the byte counter must size rows from the shape."""
    (shape0, bytes0), (shape1, bytes1) = run_distributed(_empty_all_to_all, 2)
    assert shape0 == (0, 4) and bytes0 == 3 * 4 * 4
    assert shape1 == (3, 4) and bytes1 == 0


def test_lar_prediction_uses_the_measured_requests(tiny_model):
    """``lar --limit N --profile P`` compares against the profile's requests with the measured ids."""
    from tools.semmoe.model_commands import _requests_of

    prof = load_profile(tiny_model.profile_path)
    ids = prof.meta["request_ids"]
    assert _requests_of(prof, ids, "p") is prof
    sub = _requests_of(prof, ids[:5], "p")
    np.testing.assert_array_equal(sub.routes, prof.routes[:, : prof.request_offsets[5]])
    with pytest.raises(ValueError, match="lacks 1 of the measured prompts"):
        _requests_of(prof, ids[:2] + ["nope"], "p")
