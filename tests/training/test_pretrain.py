"""End-to-end pretraining through torchrun on 2 CPU ranks: the loop, metrics, checkpoints,
exact resume, resharding, signals and bad input.

Exact resume is checked with ``==`` on the logged losses and gradient norms: the same data order,
the same RNG states and the same optimizer state must reproduce the same floats. Resharding
(EP=2 -> EP=1) compares validation losses at rtol 1e-5: only the expert GEMM row blocking differs
(see tests/foundation/test_ep_equivalence.py).
"""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import SMALL_PRETRAIN_ARGS, read_jsonl, torchrun

# end-to-end torchrun runs
pytestmark = pytest.mark.slow

MODULE = "megatron.training.pretrain_gpt"
STEP_FIELDS = {"step", "loss", "lm_loss", "aux_loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s",
               "a2a_bytes_dispatch", "a2a_bytes_combine", "a2a_time_s", "exposed_comm_s", "peak_rss_mb"}


def _tree_digest(path):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(full.encode())
            with open(full, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def test_loss_falls_and_metrics_written(run_a):
    root, save, proc = run_a
    records = read_jsonl(save / "metrics.jsonl")
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert STEP_FIELDS <= set(steps[0])
    assert steps[-1]["lm_loss"] < steps[0]["lm_loss"]
    assert all(r["a2a_bytes_dispatch"] > 0 for r in steps)
    valid = [r for r in records if r.get("event") == "valid"]
    assert valid and valid[-1]["ppl"] > 1
    # the resolved configuration goes to SAVE/config.yaml (loadable with --config), not the console
    assert "resolved configuration" not in proc.stdout
    from megatron.components.arguments import parse_configs

    again = parse_configs(["--config", str(save / "config.yaml")])
    assert again.model.num_layers == 2 and again.training.train_iters == 6 and again.checkpoint.save == str(save)
    assert {"iter_0000003", "iter_0000006", "latest_checkpointed_iteration.txt", "config.yaml"} <= set(os.listdir(save))
    assert "writer.lock" not in os.listdir(save)  # released at exit
    # the closing line says where the checkpoint and the metrics are; step lines carry elapsed/ETA
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("pretrain_gpt: finished at iteration 6") and "iter_0000006" in last and "metrics.jsonl" in last
    assert "ETA" in next(l for l in proc.stdout.splitlines() if l.startswith("iter "))


def test_exact_resume(run_a):
    root, save, _ = run_a
    resumed = root / "b"
    resumed.mkdir()
    shutil.copytree(save / "iter_0000003", resumed / "iter_0000003")
    args = SMALL_PRETRAIN_ARGS + ["--train-iters", 6, "--expert-model-parallel-size", 2,
                                  "--load", resumed, "--save", resumed, "--data-cache-path", root / "cache"]
    proc = torchrun(MODULE, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FutureWarning" not in proc.stderr  # megatron-core's deprecated-API notices on every load are quieted
    full = {r["step"]: r for r in read_jsonl(save / "metrics.jsonl") if "event" not in r}
    again = [r for r in read_jsonl(resumed / "metrics.jsonl") if "event" not in r]
    assert [r["step"] for r in again] == [4, 5, 6]
    for r in again:
        assert r["lm_loss"] == full[r["step"]]["lm_loss"]
        assert r["grad_norm"] == full[r["step"]]["grad_norm"]
        assert r["lr"] == full[r["step"]]["lr"]


def test_reshard_ep2_checkpoint_to_ep1(run_a):
    root, save, _ = run_a
    args = SMALL_PRETRAIN_ARGS + ["--train-iters", 6, "--expert-model-parallel-size", 1,
                                  "--load", save, "--data-cache-path", root / "cache",
                                  "--metrics-file", root / "reshard.jsonl"]
    proc = torchrun(MODULE, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restarting the optimizer state" in proc.stderr
    ep2 = [r for r in read_jsonl(save / "metrics.jsonl") if r.get("event") == "valid"][-1]
    ep1 = [r for r in read_jsonl(root / "reshard.jsonl") if r.get("event") == "valid"][-1]
    assert ep1["step"] == ep2["step"] == 6
    assert ep1["loss"] == pytest.approx(ep2["loss"], rel=1e-5)


def test_corrupt_checkpoint_is_reported_and_left_alone(run_a):
    root, save, _ = run_a
    bad = root / "corrupt"
    shutil.copytree(save / "iter_0000006", bad / "iter_0000006")
    shard = next(p for p in sorted((bad / "iter_0000006").iterdir()) if p.suffix == ".distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    before = _tree_digest(bad)
    args = SMALL_PRETRAIN_ARGS + ["--train-iters", 8, "--load", bad, "--save", bad,
                                  "--expert-model-parallel-size", 2, "--data-cache-path", root / "cache"]
    proc = torchrun(MODULE, args)
    assert proc.returncode != 0
    # rank 0 says it in one line; rank 1, when it says it before torchrun stops it (a loaded machine),
    # in a line of its own naming itself
    lines = [l for l in proc.stderr.splitlines() if l.startswith("pretrain_gpt: error:")]
    first = [l for l in lines if not l.startswith("pretrain_gpt: error: rank 1: ")]
    assert len(first) == 1 and all("corrupt" in l and shard.name in l for l in lines), proc.stderr[-2000:]
    assert _tree_digest(bad) == before


def test_incomplete_newest_checkpoint_is_reported(run_a, caplog):
    """An interrupted save's temp dir is never loaded (and is reported); an incomplete newest
    iter_N is an error naming it, not silently skipped; --load-fallback passes over it."""
    from megatron.components.checkpointing import CheckpointError, find_latest_checkpoint

    root, save, _ = run_a
    d = root / "partial"
    shutil.copytree(save / "iter_0000003", d / "iter_0000003")
    (d / "iter_0000009").mkdir()  # no manifest
    (d / ".tmp-iter_0000012-abcd").mkdir()
    (d / "latest_checkpointed_iteration.txt").write_text("9\n")
    with pytest.raises(CheckpointError, match="iter_0000009 is incomplete"):
        find_latest_checkpoint(str(d))
    assert ".tmp-iter_0000012-abcd is a leftover of an interrupted save" in caplog.text
    assert find_latest_checkpoint(str(d), fallback=True) == str(d / "iter_0000003")
    (d / "iter_0000009").rmdir()  # the pointer names a missing iteration: reported the same way
    with pytest.raises(CheckpointError, match="iter_0000009 is missing"):
        find_latest_checkpoint(str(d))


def test_sigterm_saves_and_resumes(tmp_path):
    """SIGTERM to torchrun after periodic saves have run: the ranks finish the step, save (the
    writer lives in the rank, so torchrun's signal to the rank's process group cannot break the
    save) and stop with exit code 75 (torchrun, itself signalled, reports no codes: the closing
    line says it); the run resumes from that checkpoint."""
    save = tmp_path / "sig"
    args = SMALL_PRETRAIN_ARGS + ["--train-iters", 400, "--expert-model-parallel-size", 2, "--save-interval", 2,
                                  "--save", save, "--data-cache-path", tmp_path / "cache"]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "-m", MODULE, *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=repo, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = save / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (
            metrics.exists() and sum(r.get("event") == "checkpoint" for r in read_jsonl(metrics)) >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    rank_errors = [l for l in err.splitlines() if l.startswith("[rank") and ("Traceback" in l or "Error" in l)]
    assert "BrokenPipeError" not in err and not rank_errors, rank_errors
    summary = [r for r in read_jsonl(metrics) if r.get("event") == "summary"][-1]
    assert summary["interrupted"] is True and summary["signal"] == "SIGTERM"
    step = summary["iteration"]
    saved = [r for r in read_jsonl(metrics) if r.get("event") == "checkpoint"]
    assert saved[-1]["step"] == step and 4 <= step < 400
    assert (save / f"iter_{step:07d}" / "manifest.json").exists()
    assert f"stopped by SIGTERM at iteration {step}" in out and "exit code 75" in out
    assert not (save / "writer.lock").exists()
    resume = torchrun(MODULE, SMALL_PRETRAIN_ARGS + [
        "--train-iters", step + 2, "--expert-model-parallel-size", 2, "--load", save, "--save", save,
        "--data-cache-path", tmp_path / "cache"])
    assert resume.returncode == 0, resume.stderr[-3000:]
    steps = [r["step"] for r in read_jsonl(metrics) if "event" not in r]
    assert steps[-2:] == [step + 1, step + 2]


@pytest.mark.parametrize("args,world,needle", [
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size 2 does not divide --num-experts 3"),
    (["--expert-model-parallel-size", "2"], 3, "world size 3"),
    (["--data-path", "/nonexistent/corpus", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"], 1, "/nonexistent/corpus"),
    (["--config", "/nonexistent.yaml"], 1, "/nonexistent.yaml"),
    (["--lr-decay-style", "zigzag"], 1, "--lr-decay-style"),
])
def test_bad_input_one_line_error(args, world, needle, monkeypatch, capsys):
    from megatron.training.pretrain_gpt import main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_unknown_flag_and_yaml_key(tmp_path, capsys):
    from megatron.training.pretrain_gpt import main

    assert main(["--num-layerz", "2"]) == 2
    assert "--num-layerz" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_layers: 2\nmoe_routr_topk: 3\n")
    assert main(["--config", str(cfg)]) == 2
    assert "moe_routr_topk" in capsys.readouterr().err


def _load_and_score(rank, world, path, ep):
    import torch

    from moe_variants.config import ParallelConfig
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from tests.helpers import forward_loss

    parallel = ParallelConfig(expert_model_parallel_size=ep)
    initialize_parallel(parallel, seed=1)
    model, configs, tokenizer, _ = load_model(path, parallel=parallel)
    ids = torch.tensor([tokenizer.tokenize("To be, or not to be, that is the question:")[:16]])
    with torch.no_grad():
        loss = forward_loss(model, ids[:, :-1], ids[:, 1:])
    return loss, configs.model.num_experts, tokenizer.detokenize(ids[0].tolist())


def test_load_model_from_checkpoint_any_layout(run_a):
    """A checkpoint carries its configs and tokenizer: tools rebuild the model at any EP."""
    from tools.spawn import run_distributed

    _, save, _ = run_a
    one = run_distributed(_load_and_score, 1, str(save), 1)[0]
    two = run_distributed(_load_and_score, 2, str(save), 2)
    assert one[1] == 4 and one[2].startswith("To be, or not")
    assert os.path.isfile(save / "iter_0000006" / "tokenizer" / "tiny_bpe.json")
    for loss, _, _ in two:
        assert torch.allclose(loss, one[0], rtol=1e-5, atol=1e-6)
