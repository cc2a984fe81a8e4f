"""The checkpoints bench_serve serves: trained per variant with ``pretrain_gpt`` (reused from the
work directory when its settings match), placed by a registered variant's checkpoint pass (e.g.
Sem-MoE tables), and their tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from megatron.common.files import write_json
from tools.bench import netns
from tools.bench.launcher import LaunchError, start_ranks

from .variant_configs import placed, train_config

__all__ = ["train", "place", "tokenizer_and_context", "TRAIN_MODULE"]

TRAIN_MODULE = "megatron.training.pretrain_gpt"


def finished(marker: str, key: dict) -> bool:
    """Whether a work-directory product (a trained or placed checkpoint) can be reused: its
    ``marker`` JSON, written last when the product was complete, equals ``key``."""
    try:
        with open(marker) as f:
            return json.load(f) == key
    except (OSError, ValueError):
        return False


def train(args, variants, work_dir, budget, printer) -> dict:
    """One checkpoint per variant, trained with ``pretrain_gpt`` on loopback (same seed, same data);
    a checkpoint already in the work directory with the same settings is reused."""
    from megatron.components.checkpointing import find_latest_checkpoint

    out = {}
    for variant in variants:
        run_dir = os.path.join(work_dir, f"train-{variant}")
        save = os.path.join(run_dir, "ckpt")
        values = train_config(args, variant, save)
        config_path = os.path.join(run_dir, "config.json")
        if finished(config_path, values) and find_latest_checkpoint(save) is not None:
            printer.line(f"[{variant}] reusing the checkpoint in {save}")
            out[variant] = save
            continue
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        write_json(config_path + ".run",
                   dict(values, data_cache_path=values.get("data_cache_path") or os.path.join(run_dir, "data_cache")))
        t0 = time.monotonic()
        printer.line(f"[{variant}] training {args.train_steps} steps on {args.ranks} ranks (loopback) ...")
        net = netns.LoopbackNetwork(args.ranks, "training")
        with start_ranks(net, ["-m", TRAIN_MODULE, "--config", config_path + ".run"], run_dir,
                         num_threads=args.threads) as ranks:
            ranks.wait(budget.remaining())
        if find_latest_checkpoint(save) is None:
            raise LaunchError(f"training {variant} left no checkpoint in {save}")
        write_json(config_path, values)  # written last: it marks the checkpoint as complete for reuse
        printer.line(f"[{variant}] trained in {time.monotonic() - t0:.0f}s")
        out[variant] = save
    return out


def place(args, variants, work_dir, printer) -> dict:
    """The placed checkpoint of each placed variant (its ``tools.variants.ServePlacement`` pass run into
    the work directory; one placed there from the same checkpoint and inputs is reused)."""
    import subprocess

    from tools import repo_root
    from tools import variants as variant_hooks

    out = {}
    for v in placed(variants):
        placement = variant_hooks.serve_placement(v, args)
        run_dir = os.path.join(work_dir, f"placed-{v}")
        ckpt, marker = os.path.join(run_dir, "ckpt"), os.path.join(run_dir, "placed.json")
        key = {"load": os.path.abspath(args.load), **placement.key}
        if finished(marker, key):
            printer.line(f"[{v}] reusing the placed checkpoint in {ckpt}")
            out[v] = ckpt
            continue
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        command = placement.command(args.load, ckpt)
        printer.line(f"[{v}] placing the experts of {args.load} ({' '.join(command[:3])}) ...")
        proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, cwd=repo_root(),
                              env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
        if proc.returncode != 0:
            raise LaunchError(f"{' '.join(command[:3])} failed for {v}:\n{proc.stderr[-2000:]}")
        write_json(marker, key)  # written last: marks the placed checkpoint as complete for reuse
        out[v] = ckpt
    return out


def tokenizer_and_context(ckpt: str):
    from megatron.components.loading import checkpoint_configs, load_tokenizer

    configs, manifest, path = checkpoint_configs(ckpt)
    return load_tokenizer(manifest, path), int(configs.model.seq_length)
