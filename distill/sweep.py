"""The FCSD paper's two short sweeps (FarSkip-Collective §5.1): batch size, then learning rate.

    python -m distill.sweep --load CKPT --root SWEEP_DIR --steps 2000 \\
        --batch-tokens 65536,131072,262144 --lrs 2e-5,4e-5,8e-5 [--nproc 8] -- [distill.fcsd flags ...]

Stage 1 runs ``distill.fcsd`` for ``--steps`` steps at every ``--batch-tokens`` (global batch in
tokens = global batch size x seq length) with the first learning rate; stage 2 runs every
``--lrs`` at the chosen batch size. Each stage picks the run with the lowest training loss (the
optimised loss, averaged over the last ``--select-window`` logged steps, read from the run's
``metrics.jsonl``), as the paper selects. Runs go to ``SWEEP_DIR/bt{tokens}_lr{lr}``; a run
directory that already holds a finished run (its ``metrics.jsonl`` has a summary) is reused, so an
interrupted sweep resumes. ``SWEEP_DIR/sweep.json`` (written atomically) records every run and the
choice; a table is printed. Flags after ``--`` go to every ``distill.fcsd`` run (data, farskip,
loss, early stopping ...); the sweep sets ``--train-iters --global-batch-size --lr --save``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from megatron.common.cli import UserError, float_list, one_line, user_input

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the runs start from the checkout


def _floats(text: str) -> list[float]:
    values = float_list(text)
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _ints(text: str) -> list[int]:
    values = _floats(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected whole numbers, got {text!r}")
    return [int(v) for v in values]


def training_loss(metrics_path: str, window: int) -> tuple[float, bool]:
    """(mean optimised loss over the last ``window`` logged steps, whether the run finished).

    The optimised loss is ``kd_loss`` (the distillation objective of ``kl`` / ``kl+l2``) when the
    run logs it, else ``loss`` (next-token loss + aux, what ``sft`` optimises).
    """
    if not os.path.isfile(metrics_path):
        raise ValueError(f"{metrics_path}: no metrics (did the run start?)")
    steps, finished = [], False
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if "event" in record:  # evaluations, checkpoints, the final summary
                finished = finished or record["event"] == "summary"
            elif "loss" in record and not record.get("skipped"):
                steps.append(record.get("kd_loss", record["loss"]))
    if not steps:
        raise ValueError(f"{metrics_path}: no logged training steps")
    tail = steps[-window:]
    return sum(tail) / len(tail), finished


def global_batch_size(batch_tokens: int, seq_length: int, micro_batch_size: int, data_parallel: int) -> int:
    """Global batch (sequences) for a token budget; must be a whole number of micro-batches per rank."""
    gbs, rem = divmod(batch_tokens, seq_length)
    if rem or gbs % (micro_batch_size * data_parallel):
        raise UserError(f"--batch-tokens {batch_tokens} is not a multiple of seq_length {seq_length} x "
                        f"micro-batch {micro_batch_size} x data-parallel {data_parallel}")
    return gbs


def run_one(args, run_dir: str, batch_tokens: int, lr: float, gbs: int) -> dict:
    metrics = os.path.join(run_dir, "metrics.jsonl")
    finished = False
    if os.path.isfile(metrics):
        try:
            _, finished = training_loss(metrics, args.select_window)
        except ValueError:
            finished = False
    if not finished:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "distill.fcsd", "--load", args.load, "--save", run_dir, "--train-iters", str(args.steps),
               "--global-batch-size", str(gbs), "--lr", str(lr), "--save-interval", str(10 ** 9),
               *args.fcsd_args]
        print(f"fcsd_sweep: {' '.join(cmd)}", flush=True)
        result = subprocess.run(cmd, cwd=REPO)
        if result.returncode != 0:
            raise RuntimeError(f"fcsd_sweep: run {run_dir} failed with exit code {result.returncode}")
    loss, _ = training_loss(metrics, args.select_window)
    return {"batch_tokens": batch_tokens, "global_batch_size": gbs, "lr": lr, "train_loss": loss, "dir": run_dir}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    fcsd_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="fcsd_sweep.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="the checkpoint to convert")
    p.add_argument("--root", required=True, help="directory for the sweep's runs and sweep.json")
    p.add_argument("--steps", type=int, default=2000, help="steps per run (paper: 2000)")
    p.add_argument("--batch-tokens", type=_ints, default=[2 ** 16, 2 ** 17, 2 ** 18])
    p.add_argument("--lrs", type=_floats, default=[2e-5, 4e-5, 8e-5])
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun --nproc_per_node)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the checkpoint's")
    p.add_argument("--select-window", type=int, default=5, help="logged steps averaged for selection")
    args = p.parse_args(argv)
    args.fcsd_args = fcsd_args
    try:
        from megatron.components.checkpointing import CheckpointError
        from megatron.components.loading import checkpoint_configs

        if not os.path.exists(args.load):
            raise UserError(f"--load {args.load}: no such checkpoint")
        if args.steps < 1 or args.nproc < 1 or args.select_window < 1:
            raise UserError("--steps, --nproc and --select-window must be positive")
        configs, _, _ = checkpoint_configs(args.load)
        seq = configs.model.seq_length
        mbs = args.micro_batch_size or configs.training.micro_batch_size
        if args.micro_batch_size:
            args.fcsd_args += ["--micro-batch-size", str(mbs)]
        for flag in ("--train-iters", "--global-batch-size", "--lr", "--save"):
            if flag in args.fcsd_args:
                raise UserError(f"{flag} is set by the sweep; remove it from the distill.fcsd flags")
        tp = configs.parallel.tensor_model_parallel_size
        for i, a in enumerate(args.fcsd_args):
            if a == "--tensor-model-parallel-size":
                with user_input():
                    tp = int(args.fcsd_args[i + 1])
        dp = args.nproc // tp
        gbs = {bt: global_batch_size(bt, seq, mbs, dp) for bt in args.batch_tokens}
    except (UserError, CheckpointError) as e:
        print(f"fcsd_sweep: error: {one_line(e)}", file=sys.stderr)
        return 2
    os.makedirs(args.root, exist_ok=True)

    def run_dir(bt, lr):
        return os.path.join(args.root, f"bt{bt}_lr{lr:g}")

    stage1 = [run_one(args, run_dir(bt, args.lrs[0]), bt, args.lrs[0], gbs[bt]) for bt in args.batch_tokens]
    best_bt = min(stage1, key=lambda r: r["train_loss"])["batch_tokens"]
    stage2 = [next(r for r in stage1 if r["batch_tokens"] == best_bt)]
    stage2 += [run_one(args, run_dir(best_bt, lr), best_bt, lr, gbs[best_bt]) for lr in args.lrs[1:]]
    best = min(stage2, key=lambda r: r["train_loss"])
    payload = {"load": args.load, "steps": args.steps, "fcsd_args": args.fcsd_args, "selection": "train_loss",
               "stage1_batch_tokens": stage1, "stage2_lr": stage2,
               "choice": {"batch_tokens": best["batch_tokens"], "global_batch_size": best["global_batch_size"],
                          "lr": best["lr"]}}
    from megatron.common.files import write_json

    write_json(os.path.join(args.root, "sweep.json"), payload)
    print(json.dumps(payload["choice"]))
    print("| stage | batch tokens | lr | train loss (last %d logs) |" % args.select_window)
    print("|---|---:|---:|---:|")
    for stage, rows in (("batch size", stage1), ("learning rate", stage2)):
        for r in rows:
            mark = " ←" if r is best else ""
            print(f"| {stage} | {r['batch_tokens']} | {r['lr']:g} | {r['train_loss']:.4f}{mark} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
