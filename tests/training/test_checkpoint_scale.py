"""Checkpoints at scale: parallel verification (``--verify-checkpoint``), asynchronous saves and the
CUDA RNG tracker states.

2 gloo ranks with EP=2 (each writes its own shard, ``__<rank>_0.distcp``) and the tiny MoE of
``tests.helpers``. Comparisons are exact: a checkpoint's bytes are a deterministic function of the
state (``torch.save`` is), so an asynchronous save of a state must produce the synchronous save's
files bit for bit, and restored RNG states are compared with ``torch.equal``. Nothing depends on
timing: the asynchronous writer is held on an event until training has changed the parameters.
"""

import io
import json
import os

import pytest

from tools.spawn import run_distributed

TOKENIZER_BYTES = b'{"model": "a tokenizer file the loader never reads"}\n' * 20


def _rank_model(world):
    from megatron.components.checkpointing import layout_of
    from moe_variants.config import ParallelConfig
    from tests.helpers import build_and_load, tiny_model_config

    parallel = ParallelConfig(expert_model_parallel_size=world)
    model, _ = build_and_load(tiny_model_config(), parallel)
    return model, layout_of(parallel, None, world)


def _damage(path: str, how: str) -> None:
    size = os.path.getsize(path)
    if how == "truncate":
        os.truncate(path, size - 7)
    else:  # flip one byte in the middle, same size
        with open(path, "r+b") as f:
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))


def _verify_rank(rank, world, save_dir, mode, target, how):
    """Save with ``mode``, rank 0 damages ``target``, load with ``mode``; returns the files this rank
    hashed at save and at load, the manifest and the load's outcome."""
    import megatron.components.checkpointing as ck
    import megatron.components.checkpointing.hashing as hashing
    from megatron.common import collectives

    model, layout = _rank_model(world)
    tokenizer = os.path.join(save_dir, f"tokenizer-{rank}.json")
    with open(tokenizer, "wb") as f:
        f.write(TOKENIZER_BYTES)
    hashed = []
    real = hashing._sha256

    def recording(path):
        hashed.append(path)
        return real(path)

    hashing._sha256 = recording
    final = ck.save_checkpoint(save_dir, 1, [model], layout=layout, configs={"model": {}}, verify=mode,
                               tokenizer_files={"tokenizer_model": tokenizer})
    on_save = sorted(os.path.relpath(p, _tmp_dir_of(p)) for p in hashed)
    collectives.barrier()
    if rank == 0:
        _damage(os.path.join(final, target), how)
    collectives.barrier()
    hashed.clear()
    try:
        ck.load_checkpoint(save_dir, [model], layout=layout, verify=mode)
        outcome = "loaded"
    except ck.CheckpointError as e:
        outcome = str(e)
    on_load = sorted(os.path.relpath(p, final) for p in hashed)
    with open(os.path.join(final, ck.MANIFEST)) as f:
        manifest = json.load(f)
    return on_save, on_load, manifest, outcome


def _tmp_dir_of(path):
    """The ``.tmp-iter_*`` directory a hashed file was in (files are hashed before the rename)."""
    parts = path.split(os.sep)
    i = max(i for i, p in enumerate(parts) if p.startswith(".tmp-iter_"))
    return os.sep.join(parts[:i + 1])


def test_hash_shares_are_disjoint_cover_every_file_and_keep_each_ranks_shards():
    from megatron.components.checkpointing import hash_shares

    sizes = {"__0_0.distcp": 100, "__1_0.distcp": 90, "__1_1.distcp": 5, ".metadata": 30, "common.pt": 20,
             "metadata.json": 1, "tokenizer/t.json": 50}
    shares = hash_shares(sizes, 2)
    assert sorted(sum(shares, [])) == sorted(sizes)
    assert {"__0_0.distcp"} <= set(shares[0]) and {"__1_0.distcp", "__1_1.distcp"} <= set(shares[1])
    assert shares == hash_shares(dict(reversed(list(sizes.items()))), 2)  # deterministic
    # a smaller world than the saving one: shards of missing ranks are balanced like other files
    one, = hash_shares(sizes, 1)
    assert one == sorted(sizes)
    three = hash_shares(sizes, 3)
    assert sorted(sum(three, [])) == sorted(sizes) and all(three)


def test_full_hashes_in_parallel_and_a_corrupt_shard_is_one_line_on_every_rank(tmp_path):
    """``full``: every rank hashes its own share (its shard among them) at save and at load; a
    flipped byte in rank 1's shard is the same one-line error naming the file on both ranks."""
    results = run_distributed(_verify_rank, 2, str(tmp_path), "full", "__1_0.distcp", "flip", timeout_s=240)
    manifest = results[0][2]
    assert manifest["verify"] == "full"
    assert all("sha256" in info for info in manifest["files"].values())
    save_shares = [set(r[0]) for r in results]
    load_shares = [set(r[1]) for r in results]
    assert not save_shares[0] & save_shares[1] and save_shares[0] | save_shares[1] == set(manifest["files"])
    assert "__0_0.distcp" in save_shares[0] and "__1_0.distcp" in save_shares[1]
    # on load each rank checks the same share, in name order, up to its first bad file
    assert load_shares[0] == save_shares[0] and "__1_0.distcp" in load_shares[1] <= save_shares[1]
    messages = {r[3] for r in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "__1_0.distcp fails its sha256 check" in message and "\n" not in message, message


def test_sizes_detect_a_truncated_file_and_hash_only_the_metadata(tmp_path):
    results = run_distributed(_verify_rank, 2, str(tmp_path), "sizes", "__0_0.distcp", "truncate", timeout_s=240)
    manifest = results[0][2]
    assert manifest["verify"] == "sizes"
    assert [rel for rel, info in manifest["files"].items() if "sha256" in info] == [".metadata"]
    assert sorted(sum((r[0] for r in results), [])) == [".metadata"]
    assert sorted(sum((r[1] for r in results), [])) == [".metadata"]
    messages = {r[3] for r in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "__0_0.distcp has" in message and "bytes, expected" in message and "\n" not in message, message


def test_sizes_do_not_hash_the_shards(tmp_path):
    """A same-size change to a file other than ``.metadata`` passes ``sizes`` (what ``full`` is for)."""
    results = run_distributed(_verify_rank, 2, str(tmp_path), "sizes", "tokenizer/tokenizer-0.json", "flip",
                              timeout_s=240)
    assert [r[3] for r in results] == ["loaded", "loaded"]


def test_off_records_and_checks_nothing(tmp_path):
    """``off``: no hash is computed or recorded, and a damaged file is not looked at (the
    tokenizer file is not read by the loader, so the load goes through)."""
    results = run_distributed(_verify_rank, 2, str(tmp_path), "off", "tokenizer/tokenizer-0.json", "truncate",
                              timeout_s=240)
    manifest = results[0][2]
    assert manifest["verify"] == "off" and not any("sha256" in i for i in manifest["files"].values())
    assert all(info["bytes"] > 0 for info in manifest["files"].values())
    assert [r[0] for r in results] == [[], []] and [r[1] for r in results] == [[], []]
    assert [r[3] for r in results] == ["loaded", "loaded"]


def test_verify_checkpoint_flag_is_an_enum_with_a_stated_default():
    from megatron.components.arguments import parse_configs
    from megatron.components.config import VerifyCheckpoint

    c = parse_configs([])
    assert c.checkpoint.verify_checkpoint is VerifyCheckpoint.full and c.checkpoint.async_save is False
    c = parse_configs(["--verify-checkpoint", "sizes", "--async-save"])
    assert c.checkpoint.verify_checkpoint is VerifyCheckpoint.sizes and c.checkpoint.async_save is True


# ------------------------------------------------------------------------------------------------
# Asynchronous saves
# ------------------------------------------------------------------------------------------------


def _train_setup(world):
    import itertools

    import torch

    from megatron.components.checkpointing import layout_of
    from megatron.components.config import TrainingConfig
    from megatron.components.parallel import initialize_parallel
    from megatron.training.step import setup_model_and_optimizer, train_step
    from moe_variants.config import ParallelConfig
    from tests.helpers import VOCAB, batch, tiny_model_config

    parallel = ParallelConfig(expert_model_parallel_size=world)
    model_cfg = tiny_model_config()
    train_cfg = TrainingConfig(micro_batch_size=2, global_batch_size=2 * world, train_iters=10, lr=1e-2,
                               lr_warmup_iters=1)
    pgc = initialize_parallel(parallel, seed=3)
    chunks, optimizer, scheduler = setup_model_and_optimizer(model_cfg, parallel, train_cfg, vocab_size=VOCAB,
                                                             pg_collection=pgc)
    rank = torch.distributed.get_rank()
    tokens, labels = batch(rank)
    micro = [{"tokens": tokens, "labels": labels, "loss_mask": torch.ones_like(tokens, dtype=torch.float),
              "position_ids": torch.arange(tokens.shape[1])[None].expand_as(tokens)}]

    def step():
        return train_step(chunks, optimizer, scheduler, itertools.cycle(micro), model_cfg=model_cfg,
                          train_cfg=train_cfg, num_microbatches=1, pg_collection=pgc).lm_loss

    return chunks, optimizer, scheduler, layout_of(parallel, train_cfg, world), step


def _gate_writer():
    """Hold every asynchronous writer until the returned event is set."""
    import threading

    import megatron.components.checkpointing as ck

    gate = threading.Event()
    real = ck.PendingSave._write

    def gated(self):
        gate.wait(120)
        real(self)

    ck.PendingSave._write = gated
    return gate


def _async_vs_sync_rank(rank, world, root):
    import megatron.components.checkpointing as ck

    chunks, optimizer, scheduler, layout, step = _train_setup(world)
    for _ in range(2):
        step()
    kw = dict(consumed_samples=4, layout=layout, configs={"model": {}})
    sync = ck.save_checkpoint(os.path.join(root, "sync"), 2, chunks, optimizer, scheduler, **kw)
    gate = _gate_writer()
    final = ck.save_checkpoint(os.path.join(root, "async"), 2, chunks, optimizer, scheduler, async_save=True, **kw)
    pending = ck.pending_save()
    in_flight = pending is not None and not pending.done() and not os.path.exists(final)
    losses = [step(), step()]  # parameters and optimizer state change under the writer
    gate.set()
    done = ck.finalize_pending_save()
    return sync, final, done, in_flight, ck.pending_save() is None, losses


def test_async_save_writes_the_sync_saves_bytes_while_training_goes_on(tmp_path):
    import megatron.components.checkpointing as ck

    results = run_distributed(_async_vs_sync_rank, 2, str(tmp_path), timeout_s=300)
    sync, final, done, in_flight, cleared, losses = results[0]
    assert done == final and in_flight and cleared and losses[0] != losses[1]
    a = ck.read_manifest(sync, verify=True)
    b = ck.read_manifest(final, verify=True)
    assert set(a["files"]) == set(b["files"]) and any(r.endswith(".distcp") for r in a["files"])
    # .metadata records the directory it was written to (the temporary one); everything else is equal
    differ = sorted(r for r in a["files"] if a["files"][r]["sha256"] != b["files"][r]["sha256"])
    assert differ in ([], [".metadata"]), differ
    assert not ck.leftover_temporaries(str(tmp_path / "async"))
    with open(tmp_path / "async" / ck.LATEST_FILE) as f:
        assert f.read().strip() == "2"


def _failing_writer_rank(rank, world, save_dir):
    import errno

    import megatron.compat.dist_ckpt as dist_ckpt
    import megatron.components.checkpointing as ck

    chunks, optimizer, scheduler, layout, step = _train_setup(world)
    step()
    if rank == 1:  # this rank's writer dies mid-save (a full disk)
        def failing(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        dist_ckpt._write_buckets_in_process = failing
    ck.save_checkpoint(save_dir, 1, chunks, optimizer, scheduler, layout=layout, configs={"model": {}},
                       async_save=True)
    step()
    try:
        ck.finalize_pending_save()
    except ck.CheckpointError as e:
        return str(e)
    return "finalized"


def _failing_metadata_rank(rank, world, save_dir, async_save):
    """Save iteration 1; then iteration 2 with rank 0's ``.metadata`` write failing (a full disk in
    megatron-core's finalize, between its collectives); then load. Returns (the error, the
    iteration loaded)."""
    import errno

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    import megatron.components.checkpointing as ck

    model, layout = _rank_model(world)
    kw = dict(layout=layout, configs={"model": {}})
    ck.save_checkpoint(save_dir, 1, [model], **kw)
    real = FileSystemWriterAsync.finish
    if rank == 0:
        def failing(self, metadata, results):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(self.checkpoint_dir, ".metadata.tmp"))

        FileSystemWriterAsync.finish = failing
    try:
        ck.save_checkpoint(save_dir, 2, [model], async_save=async_save, **kw)
        ck.finalize_pending_save()
        error = "saved"
    except ck.CheckpointError as e:
        error = str(e)
    finally:
        FileSystemWriterAsync.finish = real
    return error, ck.load_checkpoint(save_dir, [model], layout=layout).iteration


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_metadata_write_on_rank0_is_one_line_on_every_rank(tmp_path, async_save):
    """Rank 0 alone writes ``.metadata`` when a save is finalized; its failure is the same one-line
    error on both ranks at once (the other rank used to wait for rank 0 in a collective until the
    process group's timeout, far beyond this test's), nothing of the save is published, and the
    previous checkpoint loads."""
    save_dir = str(tmp_path / "c")
    results = run_distributed(_failing_metadata_rank, 2, save_dir, async_save, timeout_s=180)
    (message, _), (other, _) = results
    assert message == other, results
    assert message.startswith(f"cannot save checkpoint {save_dir}/iter_0000002: No space left on device (")
    assert ".metadata" in message and "\n" not in message, message
    assert [iteration for _, iteration in results] == [1, 1]
    assert sorted(os.listdir(save_dir)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "1"


def _abandoned_rank(rank, world, save_dir):
    """An asynchronous save whose writers never finish: the ranks exit (their daemon writer threads
    die with them) before ``finalize_pending_save``."""
    import megatron.components.checkpointing as ck

    chunks, optimizer, scheduler, layout, step = _train_setup(world)
    step()
    _gate_writer()  # never set
    ck.save_checkpoint(save_dir, 1, chunks, optimizer, scheduler, layout=layout, configs={"model": {}},
                       async_save=True)
    return os.listdir(save_dir)


def _finished_writes_rank(rank, world, save_dir):
    """Every rank's shards written, but the run ends without finalizing: no manifest, no rename."""
    import megatron.components.checkpointing as ck

    chunks, optimizer, scheduler, layout, step = _train_setup(world)
    ck.save_checkpoint(save_dir, 1, chunks, optimizer, scheduler, layout=layout, configs={"model": {}},
                       async_save=True)
    ck.pending_save().thread.join()
    return ck.pending_save().error is None


def test_a_failed_async_writer_is_one_line_on_every_rank_and_leaves_nothing(tmp_path):
    import megatron.components.checkpointing as ck

    save_dir = str(tmp_path / "c")
    messages = run_distributed(_failing_writer_rank, 2, save_dir, timeout_s=300)
    assert messages[0] == messages[1], messages
    assert "No space left on device" in messages[0] and "iter_0000001" in messages[0] and "\n" not in messages[0]
    assert os.listdir(save_dir) == []  # no iter_N, no temporary directory, no latest pointer
    assert ck.find_latest_checkpoint(save_dir) is None


@pytest.mark.parametrize("rank_fn", [_abandoned_rank, _finished_writes_rank])
def test_an_unfinalized_async_save_never_loads_as_complete(tmp_path, rank_fn):
    import megatron.components.checkpointing as ck
    from megatron.training.save_dir import prepare_save_dir

    save_dir = str(tmp_path / "c")
    run_distributed(rank_fn, 2, save_dir, timeout_s=300)
    names = os.listdir(save_dir)
    assert len(names) == 1 and names[0].startswith(".tmp-iter_0000001-"), names
    assert ck.find_latest_checkpoint(save_dir) is None and ck.checkpoint_candidates(save_dir) == []
    with pytest.raises(ck.CheckpointError, match="not a complete checkpoint"):
        ck.read_manifest(os.path.join(save_dir, names[0]))
    prepare_save_dir(save_dir, resumed_from=None, start_iteration=0, lineage="x", configs={})
    assert os.listdir(save_dir) == []  # the next run's start-up removes the leftover


# ------------------------------------------------------------------------------------------------
# The CUDA RNG tracker states
# ------------------------------------------------------------------------------------------------

TRACKER_NAMES = ("data-parallel-rng", "model-parallel-rng", "expert-parallel-rng")


def _rng_items(path):
    """``{fqn: object}`` of the checkpoint's ``rng_state`` items, read from the shards."""
    import torch

    from megatron.components.checkpointing.safety import read_metadata

    metadata = read_metadata(path)
    out = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("rng_state"):
            with open(os.path.join(path, info.relative_path), "rb") as f:
                f.seek(info.offset)
                obj = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
                out[index.fqn] = obj[0] if isinstance(obj, list) else obj  # megatron-core wraps it in a list
    return out


def _tracker_rank(rank, world, save_dir):
    import torch
    from megatron.core.tensor_parallel import random as tp_random

    import megatron.components.checkpointing as ck
    from megatron.common import collectives

    model, layout = _rank_model(world)
    default_tracker = type(tp_random.get_cuda_rng_tracker()).__name__
    # on CPU set_seed installs the inference tracker (no states); a training tracker holding
    # states as CUDA would (ByteTensor generator states), distinct per rank
    tp_random.initialize_rng_tracker(force_reset=True)
    tracker = tp_random.get_cuda_rng_tracker()
    states = {name: torch.Generator().manual_seed(100 * rank + i).get_state() for i, name in enumerate(TRACKER_NAMES)}
    tracker.set_states(dict(states))
    final = ck.save_checkpoint(save_dir, 1, [model], layout=layout, configs={"model": {}})
    collectives.barrier()
    items = _rng_items(final) if rank == 0 else None
    tracker.set_states({name: torch.Generator().manual_seed(7).get_state() for name in TRACKER_NAMES})
    ck.load_checkpoint(save_dir, [model], layout=layout)
    restored = tracker.get_states()
    return (default_tracker, type(tracker).__name__, states, restored, items)


def test_cuda_rng_tracker_states_are_saved_per_rank_and_restored(tmp_path):
    import torch

    results = run_distributed(_tracker_rank, 2, str(tmp_path / "c"), timeout_s=240)
    items = results[0][4]
    saved = [obj["cuda_tracker"] for obj in items.values()]
    assert len(saved) == 2  # one rng_state per rank
    for rank, (default_tracker, tracker, states, restored, _) in enumerate(results):
        assert default_tracker == "InferenceCudaRNGStatesTracker" and tracker == "CudaRNGStatesTracker"
        assert sum(all(torch.equal(s[n], states[n]) for n in TRACKER_NAMES) for s in saved) == 1
        assert sorted(restored) == sorted(TRACKER_NAMES)
        assert all(torch.equal(restored[n], states[n]) for n in TRACKER_NAMES), rank
    assert not torch.equal(results[0][2]["model-parallel-rng"], results[1][2]["model-parallel-rng"])


def _seed_tracker_as_on_gpu(seed):
    """Install the tracker ``parallel.set_seed`` leaves on a GPU (megatron-core's
    ``model_parallel_cuda_manual_seed``: data-parallel stream ``seed``, tensor-parallel
    ``seed + 2718 + tp_rank``, expert ``seed + 1024 + 100 * ep_rank + etp_rank``), its states made
    by CPU generators; returns them."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    seeds = {
        "data-parallel-rng": seed,
        "model-parallel-rng": seed + 2718 + parallel_state.get_tensor_model_parallel_rank(),
        "expert-parallel-rng": seed + 1024 + 100 * parallel_state.get_expert_model_parallel_rank()
        + parallel_state.get_expert_tensor_parallel_rank(),
    }
    tp_random.initialize_rng_tracker(force_reset=True)
    states = {name: torch.Generator().manual_seed(s).get_state() for name, s in seeds.items()}
    tp_random.get_cuda_rng_tracker().set_states(dict(states))
    return states


def _relayout_rank(rank, world, save_dir):
    """Save at TP1 x DP2 (both ranks at TP rank 0 and EP rank 0: equal tensor-parallel and expert
    streams) with seed 7, then load at TP2, at EP2 and at TP1 x DP2 again, each started with seed 8
    as ``initialize_parallel`` and a GPU's ``set_seed`` start it. Returns the saved states and, per
    load, (tracker states and the CPU generator's state before the load, after it)."""
    import torch
    from megatron.core.tensor_parallel import random as tp_random

    import megatron.components.checkpointing as ck
    from moe_variants.config import ParallelConfig
    from tests.helpers import build_and_load, tiny_model_config

    def start(parallel, seed):
        # a padded vocabulary of 128 at TP1 and TP2 alike (96 padded to a multiple of 64 x TP)
        model, _ = build_and_load(tiny_model_config(make_vocab_size_divisible_by=64), parallel, seed=seed)
        return model, _seed_tracker_as_on_gpu(seed), ck.layout_of(parallel, None, world)

    model, saved, layout = start(ParallelConfig(), 7)
    ck.save_checkpoint(save_dir, 1, [model], layout=layout, configs={"model": {}})
    out = {"saved": (saved, torch.get_rng_state())}
    for name, parallel in [("tp2", ParallelConfig(tensor_model_parallel_size=2)),
                           ("ep2", ParallelConfig(expert_model_parallel_size=2)), ("same", ParallelConfig())]:
        model, seeded, layout = start(parallel, 8)
        before = (seeded, torch.get_rng_state())
        ck.load_checkpoint(save_dir, [model], layout=layout)
        out[name] = (before, (tp_random.get_cuda_rng_tracker().get_states(), torch.get_rng_state()))
    return out


def test_rng_states_are_restored_only_at_the_saved_layout(tmp_path):
    """Saved at TP1 x DP2 and loaded at TP2 (or EP2) with the same world size, the ranks' saved
    streams are not theirs: restoring them would give both TP (EP) ranks one tensor-parallel
    (expert) stream. Each rank keeps the states seeded for its new position; at the saved layout
    every state is restored exactly."""
    import torch

    def equal(a, b):
        return sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)

    results = run_distributed(_relayout_rank, 2, str(tmp_path / "c"), timeout_s=300)
    for stream, relayout in [("model-parallel-rng", "tp2"), ("expert-parallel-rng", "ep2")]:
        assert torch.equal(results[0]["saved"][0][stream], results[1]["saved"][0][stream])  # TP1, EP1
        after = [r[relayout][1][0] for r in results]
        assert not torch.equal(after[0][stream], after[1][stream]), relayout
        for r in results:
            (seeded, cpu_before), (tracker, cpu_after) = r[relayout]
            assert equal(tracker, seeded) and torch.equal(cpu_after, cpu_before), relayout
    for r in results:
        (tracker_saved, cpu_saved), ((seeded, cpu_before), (tracker, cpu_after)) = r["saved"], r["same"]
        assert not equal(seeded, tracker_saved) and not torch.equal(cpu_before, cpu_saved)
        assert equal(tracker, tracker_saved) and torch.equal(cpu_after, cpu_saved)


def _pretrain_rank(rank, world, argv):
    import contextlib
    import io as io_mod

    from megatron.training.pretrain_gpt import main

    out = io_mod.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main([str(a) for a in argv])
    return code, out.getvalue()


def test_resume_with_dropout_is_exact_on_cpu(tmp_path):
    """Dropout on the residual branches and the attention probabilities; on CPU both draw from
    torch's CPU generator (the tracker is the no-op one), which the checkpoint restores and which
    the data iterators built after the load must not touch. Compared with ``==``."""
    from tests.helpers import SMALL_PRETRAIN_ARGS, read_jsonl

    args = [*SMALL_PRETRAIN_ARGS, "--attention-dropout", 0.1, "--hidden-dropout", 0.1, "--train-iters", 4,
            "--save-interval", 2, "--eval-iters", 0, "--data-cache-path", tmp_path / "cache"]
    full = tmp_path / "full"
    code, out = run_distributed(_pretrain_rank, 1, args + ["--save", full], timeout_s=240)[0]
    assert code == 0, out
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    import shutil

    shutil.copytree(full / "iter_0000002", resumed / "iter_0000002")
    code, out = run_distributed(_pretrain_rank, 1, args + ["--save", resumed, "--load", resumed], timeout_s=240)[0]
    assert code == 0, out

    def steps(path):
        return {r["step"]: (r["lm_loss"], r["grad_norm"]) for r in read_jsonl(path / "metrics.jsonl") if "event" not in r}

    a, b = steps(full), steps(resumed)
    assert sorted(b) == [3, 4] and all(a[s] == b[s] for s in b), (a, b)
