"""Checkpoints that survive reuse, hostile files and bad input (issue 22), in-process and fast.

Runs of ``pretrain_gpt.main`` go through ``run_distributed`` (one gloo rank, the tiny model of
``SMALL_PRETRAIN_ARGS``, one ``main`` per forked rank because ``main`` tears its process group
down); the end-to-end torchrun cases (signals, killed ranks and launchers) are in
``test_preemption.py``. Nothing here depends on timing.
"""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import SMALL_PRETRAIN_ARGS, read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = [str(a) for a in SMALL_PRETRAIN_ARGS] + ["--eval-iters", "1", "--log-interval", "1"]


def main_in_rank(rank, world, module, argv):
    """``<module>.main(argv)`` in a forked rank (so the pytest process itself never builds a model:
    an OpenMP pool used before a fork can hang the forked ranks of later tests); (exit code,
    stdout, stderr)."""
    import importlib
    import logging

    main = importlib.import_module(module).main
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    logging.getLogger().addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        logging.getLogger().removeHandler(handler)
    return code, out.getvalue(), err.getvalue()


def _main_rank(rank, world, argv):
    """``pretrain_gpt.main(argv)`` in a rank; (exit code, stdout, stderr)."""
    return main_in_rank(rank, world, "megatron.training.pretrain_gpt", argv)


def run_main(argv, world=1):
    from tools.spawn import run_distributed

    return run_distributed(_main_rank, world, [str(a) for a in argv], timeout_s=240)[0]


def _error_lines(err):
    return [line for line in err.splitlines() if "error:" in line]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("reliability_cache"))


def _iters(path):
    return sorted(n for n in os.listdir(path) if n.startswith("iter_"))


# ------------------------------------------------------------------------------------------------
# --save at start-up (item 1) and Megatron's --save DIR --load DIR idiom (item 6)
# ------------------------------------------------------------------------------------------------


def test_reused_save_dir_refused_at_start_and_pruning_keeps_other_runs(tmp_path, cache):
    """Another run's checkpoints in --save: refused before training, in one line naming the
    directory, the differing setting and the three choices; nothing in the directory changes.
    Resuming with --load prunes only this run's lineage: another run's checkpoint is kept and the
    latest pointer names a complete checkpoint."""
    save = tmp_path / "run"
    code, out, err = run_main(SHORT + ["--train-iters", 2, "--save", save, "--save-interval", 1,
                                       "--data-cache-path", cache])
    assert code == 0, err
    assert _iters(save) == ["iter_0000001", "iter_0000002"]
    before = {n: os.path.getmtime(save / n) for n in os.listdir(save)}

    code, out, err = run_main(SHORT + ["--train-iters", 2, "--num-layers", 1, "--save", save,
                                       "--data-cache-path", cache])
    errors = _error_lines(err)
    assert code == 2 and len(errors) == 1, err
    line = errors[0]
    for needle in (str(save), "num_layers", "--load", "--overwrite-save", "new --save"):
        assert needle in line, line
    assert "iter " not in out  # refused before any step
    assert {n: os.path.getmtime(save / n) for n in os.listdir(save)} == before

    # another run's checkpoint (other lineage) sits in the directory, older than the resumed one
    shutil.copytree(save / "iter_0000001", save / "iter_0000000")
    manifest = json.loads((save / "iter_0000000" / "manifest.json").read_text())
    manifest.update(iteration=0, lineage="someone-else")
    (save / "iter_0000000" / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = run_main(SHORT + ["--train-iters", 4, "--save", save, "--load", save, "--save-interval", 1,
                                       "--keep-last-checkpoints", 1, "--data-cache-path", cache])
    assert code == 0, err
    assert f"starting at iteration 2 (resumed from {save / 'iter_0000002'})" in out  # the newest of this run
    assert "another run: kept, never pruned" in err
    assert _iters(save) == ["iter_0000000", "iter_0000004"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


def test_overwrite_save_replaces_the_other_run(tmp_path, cache):
    save = tmp_path / "run"
    assert run_main(SHORT + ["--train-iters", 1, "--save", save, "--data-cache-path", cache])[0] == 0
    code, out, err = run_main(SHORT + ["--train-iters", 2, "--save", save, "--overwrite-save",
                                       "--data-cache-path", cache])
    assert code == 0, err
    assert f"--overwrite-save: deleted {save / 'iter_0000001'}" in err
    assert _iters(save) == ["iter_0000002"]
    assert [r["step"] for r in read_jsonl(save / "metrics.jsonl") if "event" not in r] == [1, 2]


def test_save_load_same_dir_starts_from_scratch_and_other_missing_load_is_an_error(tmp_path, cache):
    """``--save DIR --load DIR`` on a first run (DIR does not exist) starts from scratch with one
    log line; a --load that differs from --save and does not exist stays an error."""
    d = tmp_path / "fresh"
    code, out, err = run_main(SHORT + ["--train-iters", 1, "--save", d, "--load", d, "--data-cache-path", cache])
    assert code == 0, err
    assert out.count("starting from scratch") == 1 and f"no checkpoint in {d} yet" in out
    assert _iters(d) == ["iter_0000001"]
    code, out, err = run_main(SHORT + ["--train-iters", 1, "--save", tmp_path / "other",
                                       "--load", tmp_path / "missing", "--data-cache-path", cache])
    assert code == 2 and _error_lines(err) == [f"pretrain_gpt: error: --load {tmp_path / 'missing'}: no such directory"]


def test_architecture_mismatch_is_one_line_before_any_tensor_is_read(tmp_path, cache, monkeypatch):
    """--load of a different architecture: the manifest's configs name the differing fields, and
    megatron-core's loader is never called (no tensor read, no 175-line CheckpointException)."""
    save = tmp_path / "a"
    assert run_main(SHORT + ["--train-iters", 1, "--save", save, "--data-cache-path", cache])[0] == 0

    def fail(*a, **k):
        raise AssertionError("dist_checkpointing.load called")

    import megatron.core.dist_checkpointing as dc

    monkeypatch.setattr(dc, "load", fail)  # inherited by the forked rank
    code, out, err = run_main(SHORT + ["--train-iters", 2, "--hidden-size", 32, "--load", save,
                                       "--data-cache-path", cache])
    errors = _error_lines(err)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert "holds a different model" in errors[0] and "hidden_size 64 vs 32" in errors[0], errors[0]


# ------------------------------------------------------------------------------------------------
# Recovery (item 3)
# ------------------------------------------------------------------------------------------------


def test_corrupt_newest_reported_fallback_and_moved_aside(tmp_path, cache):
    """A corrupt newest checkpoint is an error naming it; --load-fallback resumes from the one
    before, and the next save moves the bad one aside (kept, renamed) instead of colliding."""
    save = tmp_path / "run"
    assert run_main(SHORT + ["--train-iters", 2, "--save", save, "--save-interval", 1,
                             "--data-cache-path", cache])[0] == 0
    shard = next(p for p in sorted((save / "iter_0000002").iterdir()) if p.suffix == ".distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    (save / ".tmp-iter_0000003-dead").mkdir()  # an interrupted save's leftover
    resume = SHORT + ["--train-iters", 3, "--save", save, "--load", save, "--save-interval", 1,
                      "--data-cache-path", cache]
    code, out, err = run_main(resume)
    errors = _error_lines(err)
    assert code == 2 and len(errors) == 1, err
    assert "iter_0000002 is corrupt" in errors[0] and shard.name in errors[0] and "--load-fallback" in errors[0]
    assert _iters(save) == ["iter_0000001", "iter_0000002"]

    code, out, err = run_main(resume + ["--load-fallback"])
    assert code == 0, err
    assert f"starting at iteration 1 (resumed from {save / 'iter_0000001'})" in out  # the good one, named
    names = sorted(os.listdir(save))
    aside = [n for n in names if n.startswith("iter_0000002.corrupt-")]
    assert len(aside) == 1 and os.path.isfile(save / aside[0] / shard.name)  # moved, not deleted
    assert {"iter_0000002", "iter_0000003"} <= set(names)
    assert not any(n.startswith(".tmp-iter_") for n in names)
    assert "left by an interrupted save" in err


# ------------------------------------------------------------------------------------------------
# Preemption, the checkpoint writer and the save-directory lock (item 2)
# ------------------------------------------------------------------------------------------------


def _signal_after_first_step(rank, world, argv, metrics, signum):
    import threading

    def send():
        while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
            time.sleep(0.05)
        os.kill(os.getpid(), signum)

    threading.Thread(target=send, daemon=True).start()
    return _main_rank(rank, world, argv)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_and_exits_with_the_preempted_code(tmp_path, cache, signum):
    """A signalled run saves where it stopped and exits 75 (not 0, which means finished)."""
    from tools.spawn import run_distributed

    save = tmp_path / "run"
    argv = [str(a) for a in SHORT + ["--train-iters", 1000, "--save", save, "--data-cache-path", cache]]
    code, out, err = run_distributed(_signal_after_first_step, 1, argv, str(save / "metrics.jsonl"), signum,
                                     timeout_s=240)[0]
    assert code == 75, err
    summary = [r for r in read_jsonl(save / "metrics.jsonl") if r.get("event") == "summary"][-1]
    step = summary["iteration"]
    assert summary["interrupted"] and 1 <= step < 1000
    assert _iters(save) == [f"iter_{step:07d}"]
    assert f"stopped by {signal.Signals(signum).name} at iteration {step}" in out


def _save_and_list_children(rank, world, path):
    import multiprocessing

    import psutil

    from megatron.components.checkpointing import layout_of, save_checkpoint
    from moe_variants.config import ParallelConfig
    from tests.helpers import build_and_load, tiny_model_config

    parallel = ParallelConfig(expert_model_parallel_size=world)
    model, _ = build_and_load(tiny_model_config(), parallel)
    save_checkpoint(path, 1, [model], layout=layout_of(parallel, None, world), configs={"model": {}})
    return [c.pid for c in psutil.Process().children(recursive=True)], len(multiprocessing.active_children())


def test_checkpoint_save_starts_no_processes(tmp_path):
    """The writer runs in the rank itself: no Manager server, resource tracker or forked writer
    that a signal to the rank's process group could kill or a SIGKILLed rank could orphan."""
    from tools.spawn import run_distributed

    for children, active in run_distributed(_save_and_list_children, 2, str(tmp_path / "c")):
        assert children == [] and active == 0
    assert os.path.isfile(tmp_path / "c" / "iter_0000001" / "manifest.json")


_HOLDER = """
import sys, time
sys.path.insert(0, {repo!r})
from megatron.training.save_dir import SaveDirLock
lock = SaveDirLock({path!r}).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_lock_refuses_a_second_writer_and_takes_over_a_dead_ones(tmp_path, caplog):
    from megatron.training.save_dir import SaveDirLock

    holder = subprocess.Popen([sys.executable, "-c", _HOLDER.format(repo=REPO, path=str(tmp_path))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"is in use by another run \(pid {holder.pid} on "):
            SaveDirLock(str(tmp_path)).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = SaveDirLock(str(tmp_path)).acquire()  # the kernel dropped the dead holder's lock
    try:
        assert f"taking over the stale lock of pid {holder.pid}" in caplog.text
        assert json.loads((tmp_path / "writer.lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert not (tmp_path / "writer.lock").exists()


# ------------------------------------------------------------------------------------------------
# Files we did not write (item 4)
# ------------------------------------------------------------------------------------------------


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def damaged_copy(src, dst, damage: str, payload) -> str:
    """Copy checkpoint ``src`` to ``dst`` and damage its iteration: ``truncated_shard`` (half of one
    shard) or ``crafted_metadata`` (a .metadata whose unpickling would create ``payload``). Returns
    the text the one-line error must contain."""
    shutil.copytree(src, dst)
    it = next(p for p in dst.iterdir() if p.name.startswith("iter_"))
    if damage == "truncated_shard":
        shard = next(p for p in sorted(it.iterdir()) if p.suffix == ".distcp")
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
        return f"is corrupt: {shard.name} has"
    _craft_metadata(str(it), payload)
    return "unsafe checkpoint"


def _craft_metadata(ckpt, marker):
    """Replace .metadata with a pickle that runs a command, and fix up the manifest's hashes as
    whoever crafts a checkpoint would."""
    import hashlib
    import pickle

    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    manifest_path = os.path.join(ckpt, "manifest.json")
    manifest = json.load(open(manifest_path))
    data = open(os.path.join(ckpt, ".metadata"), "rb").read()
    manifest["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    json.dump(manifest, open(manifest_path, "w"))


def test_crafted_metadata_fails_in_one_line_and_never_runs(tmp_path, cache):
    save = tmp_path / "run"
    assert run_main(SHORT + ["--train-iters", 1, "--save", save, "--data-cache-path", cache])[0] == 0
    marker = tmp_path / "PWNED"
    _craft_metadata(str(save / "iter_0000001"), marker)
    code, out, err = run_main(SHORT + ["--train-iters", 2, "--save", save, "--load", save, "--data-cache-path", cache])
    errors = _error_lines(err)
    assert code == 2 and len(errors) == 1, err
    assert "unsafe checkpoint" in errors[0] and "posix.system" in errors[0], errors[0]
    assert not marker.exists()


def test_weights_only_reader_refuses_a_crafted_common_pt(tmp_path):
    """common.pt goes through torch.load(weights_only=True) even when the environment would turn
    torch's default off."""
    import torch

    from megatron.components.checkpointing.safety import UnsafeCheckpoint, _weights_only_load

    marker = tmp_path / "PWNED"
    torch.save({"x": _Payload(marker)}, tmp_path / "common.pt")
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with pytest.raises(UnsafeCheckpoint, match="holds more than tensors"):
            _weights_only_load(str(tmp_path / "common.pt"), "common.pt")
    finally:
        del os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"]
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------
# One-line errors (item 5)
# ------------------------------------------------------------------------------------------------


def _save_with_failing_io(rank, world, path, errno_code, where):
    import os as os_mod

    from megatron.components.checkpointing import CheckpointError, layout_of, save_checkpoint
    from moe_variants.config import ParallelConfig
    from tests.helpers import build_and_load, tiny_model_config

    parallel = ParallelConfig()
    model, _ = build_and_load(tiny_model_config(), parallel)
    real = getattr(os_mod, where)

    def failing(*a, **k):
        raise OSError(errno_code, os_mod.strerror(errno_code))

    setattr(os_mod, where, failing)
    try:
        save_checkpoint(path, 1, [model], layout=layout_of(parallel, None, world), configs={"model": {}})
    except CheckpointError as e:
        return str(e)
    finally:
        setattr(os_mod, where, real)
    return "saved"


@pytest.mark.parametrize("errno_name,where,needle", [
    ("ENOSPC", "fsync", "No space left on device"),  # a full disk while the shards are written
    ("EROFS", "makedirs", "Read-only file system"),  # a read-only save directory
])
def test_full_disk_and_read_only_save_are_one_line(tmp_path, errno_name, where, needle):
    import errno

    from tools.spawn import run_distributed

    message = run_distributed(_save_with_failing_io, 1, str(tmp_path / "c"), getattr(errno, errno_name), where)[0]
    assert needle in message and "\n" not in message and str(tmp_path / "c") in message, message
    assert not os.path.exists(tmp_path / "c" / "iter_0000001")
    assert not any(n.startswith(".tmp-") for n in os.listdir(tmp_path / "c")) if os.path.isdir(tmp_path / "c") else True


def test_read_only_save_dir_refused_at_start(tmp_path, monkeypatch):
    import errno

    from megatron.training.save_dir import SaveDirLock

    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ValueError, match=r"--save .*: cannot write there \(Read-only file system\)"):
        SaveDirLock(str(tmp_path)).acquire()


def test_token_ids_beyond_the_vocabulary_are_one_line(tmp_path, cache):
    from megatron.training.preprocess import write_indexed_dataset

    prefix = str(tmp_path / "corpus")
    docs = [[i % 300 for i in range(j, j + 200)] for j in range(0, 4000, 200)]
    write_indexed_dataset(iter(docs), prefix, 300)
    code, out, err = run_main(SHORT + ["--train-iters", 1, "--data-path", prefix, "--tokenizer-type", "NullTokenizer",
                                       "--vocab-size", 100, "--data-cache-path", cache])
    assert code == 2 and _error_lines(err) == [
        f"pretrain_gpt: error: --data-path {prefix}: holds token id 299, but the tokenizer has 101 ids "
        "(was it preprocessed with another tokenizer or --vocab-size?)"], err


@pytest.mark.parametrize("yaml_text,argv,needle", [
    ("num_layers: \"four\"\n", [], "num_layers: expected an integer, got 'four'"),
    ("lr: [1]\n", [], "lr: expected a number"),
    ("", ["--train-iters", "-5"], "--train-iters must be a positive number of steps, got -5"),
    ("train_iters: 0\n", [], "--train-iters must be a positive number of steps, got 0"),
    ("", ["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be > 0"),
    ("", ["--keep-last-checkpoints", "-1"], "--keep-last-checkpoints must be >= 0"),
    ("", ["--overwrite-save"], "--overwrite-save needs --save DIR"),
])
def test_bad_values_are_one_line(tmp_path, capsys, monkeypatch, yaml_text, argv, needle):
    from megatron.training.pretrain_gpt import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text or "seed: 1\n")
    assert main(["--config", str(cfg), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_yaml_numbers_in_exponent_form_are_floats(tmp_path):
    """PyYAML (YAML 1.1) reads ``3e-3`` as a string; the config layer accepts it as the float it is."""
    from megatron.components.arguments import parse_configs

    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 3e-3\nmin_lr: 1e-5\nmoe_aux_loss_coeff: 1e-2\nnum_layers: 2\n")
    c = parse_configs(["--config", str(cfg)])
    assert c.training.lr == 0.003 and isinstance(c.training.lr, float)
    assert c.training.min_lr == 1e-5 and c.model.moe_aux_loss_coeff == 0.01 and c.model.num_layers == 2


def test_distributed_timeout_reaches_the_process_group(monkeypatch, capsys):
    """--distributed-timeout-minutes (Megatron-LM's flag) is the timeout the process groups get."""
    import megatron.components.parallel as parallel
    from megatron.training.pretrain_gpt import main

    seen = {}

    from megatron.common.cli import UserError

    def fake(parallel_cfg, **kwargs):
        seen.update(kwargs)
        raise UserError("stop here")

    monkeypatch.setattr(parallel, "initialize_parallel", fake)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(["--distributed-timeout-minutes", "2.5"]) == 2
    assert seen["timeout_minutes"] == 2.5
    assert main(["--seed", "1"]) == 2 and seen["timeout_minutes"] == 10.0  # Megatron-LM's default


# ------------------------------------------------------------------------------------------------
# Friction (item 7)
# ------------------------------------------------------------------------------------------------


def test_help_lists_help_defaults_and_choices(capsys):
    from megatron.training.pretrain_gpt import main

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    flat = " ".join(text.split())
    assert "--num-layers N transformer layers (default: 4)" in flat
    assert "--moe-token-dispatcher-type {alltoall,allgather}" in flat
    assert "--lr-decay-style {constant,linear,cosine,inverse-square-root,WSD}" in flat
    assert "--distributed-timeout-minutes X timeout of torch.distributed collectives" in flat
    assert "--moe-variant {standard,bigmac} the MoE layer class: standard, or a registered variant's (default: standard)" in flat
    assert "--optimizer {adam,sgd}" in flat and "--wandb-mode {offline,online,disabled}" in flat
    assert "MOEVARIANT" not in text and "--no-no-load-optim" not in text
    assert "--no-load-optim load weights" in flat and "--no-no-load-rng" not in text
    assert "Exit codes: 0 finished, 75 stopped by a signal" in flat
    from megatron.components.arguments import parse_configs

    assert parse_configs(["--no-load-optim"]).checkpoint.no_load_optim is True


def test_fcsd_help_without_load(capsys):
    from distill.fcsd import main

    assert main(["--help"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "--proxy-text STR" in flat and "validation split" in flat


def test_semmoe_expert_model_parallel_size_and_out_refused(tmp_path, capsys):
    from moe_variants.semmoe.profile import save_profile
    from moe_variants.semmoe.synthetic import SyntheticConfig, synthetic_profile
    from tools.semmoe.cli import main

    save_profile(synthetic_profile(SyntheticConfig(num_layers=2, num_experts=8), seed=0), tmp_path / "p.npz")
    base = ["solve", "--profile", str(tmp_path / "p.npz"), "--method", "contiguous", "--out", str(tmp_path / "t")]
    assert main(base + ["--expert-model-parallel-size", "2"]) == 0
    written = (tmp_path / "t" / "tables.npz").read_bytes()
    capsys.readouterr()
    assert main(base + ["--ep", "4"]) == 2  # the alias; an existing --out is refused
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m tools.semmoe: error: --out {tmp_path / 't'} exists (pass --overwrite to replace it)"]
    assert (tmp_path / "t" / "tables.npz").read_bytes() == written
    assert main(base + ["--ep", "4", "--overwrite"]) == 0
    assert (tmp_path / "t" / "tables.npz").read_bytes() != written


def test_netsim_fit_rejects_binary_and_single_size_input(tmp_path, capsys):
    from netsim.cli import main

    binary = tmp_path / "cal.csv"
    binary.write_bytes(bytes(range(256)) * 8)
    assert main(["fit", "--csv", str(binary)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(binary) in err[0] and "not a text CSV file" in err[0], err
    one = tmp_path / "one.csv"
    one.write_text("op,ranks,bytes,seconds\nall_to_all,2,4096,0.001\n")
    assert main(["fit", "--csv", str(one)]) == 2
    captured = capsys.readouterr()
    assert "inf" not in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "two or more message sizes" in err[0], err


def test_readme_commands_say_to_use_the_venv():
    text = open(os.path.join(REPO, "README.md")).read()
    assert "source .venv/bin/activate" in text
    script = open(os.path.join(REPO, "scripts", "prepare_pretrain_corpus.sh")).read()
    assert ".venv/bin/python" in script
