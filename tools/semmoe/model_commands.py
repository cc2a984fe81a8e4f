"""Model-side subcommands of ``python -m tools.semmoe`` (registered in ``commands.COMMANDS``).

* ``profile``  run a checkpoint over prompts (any TP/EP, torchrun) -> profile .npz
* ``apply``    permute a checkpoint's experts and router rows by tables -> placed checkpoint
* ``lar``      measure the LAR of a (placed) checkpoint in a real forward at EP = D with the
               tables' scheduling (``dp``: TP = 1, Algorithm 2; ``tp``: TP = D as the server
               runs it, Algorithm 3)

Inputs are checked in the calling process before any rank starts, so bad input is a one-line
error and nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megatron.common.cli import UserError, positive_int, user_input
from megatron.common.files import atomic_write

from .commands import command

__all__: list[str] = []


def _quiet() -> None:
    import warnings

    from megatron import compat

    compat.quiet_warnings()
    # megatron-core's dist_checkpointing load path (torch deprecations, harmless here)
    for pattern in ("`load_state_dict` is deprecated", "Please use DTensor instead"):
        warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)


def _run_options(args: argparse.Namespace):
    from .model_run import RunOptions

    return RunOptions(
        load=args.load,
        data=args.data,
        tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", 1),
        max_tokens=args.max_tokens,
        batch_tokens=args.batch_tokens,
        limit=args.limit,
        seed=args.seed,
    )


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", required=True, help="checkpoint (save dir or iter_N dir)")
    p.add_argument("--data", required=True, help="prompts JSONL (one {\"text\": ...} per line)")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help="truncate prompts to this many tokens (default: the model's context)")
    p.add_argument("--batch-tokens", type=positive_int, default=2048,
                   help="padded tokens per forward (requests are batched, longest first)")
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N prompts")
    p.add_argument("--seed", type=int, default=1234)


def _check_output_file(out: str) -> None:
    path = Path(out)
    if path.is_dir():
        raise UserError(f"--out {out}: is a directory, expected a file path")
    if path.exists():
        raise UserError(f"--out {out}: exists; refusing to overwrite (choose a new path)")
    if not path.parent.is_dir():
        raise UserError(f"--out {out}: parent directory {path.parent} does not exist")


@user_input()
def _check_run_inputs(args: argparse.Namespace, nproc: int):
    """Prompts readable, checkpoint present, layout valid for ``nproc`` ranks; returns the manifest."""
    from moe_variants.config import ModelConfig, validate

    from megatron.components.loading import find_checkpoint
    from .model_run import read_prompts

    read_prompts(args.data, args.limit)
    ckpt, manifest = find_checkpoint(args.load)
    model_cfg = ModelConfig.from_dump(manifest["configs"])
    if not model_cfg.num_experts:
        raise ValueError(f"--load {args.load}: not an MoE checkpoint")
    validate(model_cfg, _run_options(args).parallel(), nproc)
    return ckpt, manifest


def _finish_rank() -> None:
    import torch.distributed as dist

    from megatron.common import collectives

    if dist.is_initialized():
        collectives.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------- profile


def _configure_profile(p: argparse.ArgumentParser) -> None:
    _add_run_arguments(p)
    p.add_argument("--out", required=True, help="profile .npz to write")
    p.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    p.add_argument("--expert-model-parallel-size", type=positive_int, default=1)
    p.add_argument("--expert-tensor-parallel-size", type=positive_int, default=1)
    p.add_argument("--nproc", type=positive_int, default=None,
                   help="ranks to start (default TP x EP); data parallelism takes the rest")


@command("profile", "run a checkpoint over prompts and record its routing (profile .npz)", _configure_profile)
def _profile(args: argparse.Namespace) -> int:
    _quiet()
    from .model_run import profile_rank
    from moe_variants.semmoe.profile import save_profile
    from megatron.components.parallel import single_process_group

    from megatron.common import collectives

    from .runtime import in_torchrun, run_under_torchrun

    opts = _run_options(args)
    if in_torchrun():
        t0 = time.perf_counter()
        profile = profile_rank(opts)

        def write():  # rank 0 alone: the others wait for its outcome, not in a barrier it never reaches
            save_profile(profile, args.out)
            print(f"profile: {profile.num_requests} requests, {profile.num_tokens} tokens, {profile.num_layers} "
                  f"MoE layers x {profile.num_experts} experts (top-{profile.top_k}), "
                  f"{profile.meta.get('vocab_extended', 0)} unseen tokens mapped by embedding nearest neighbour, "
                  f"{time.perf_counter() - t0:.1f}s -> {args.out}", flush=True)  # fmt: skip

        collectives.agreed(write, src=0)
        _finish_rank()
        return 0
    nproc = args.nproc or args.tensor_model_parallel_size * args.expert_model_parallel_size
    _check_output_file(args.out)
    _check_run_inputs(args, nproc)
    if nproc > 1:
        return run_under_torchrun(nproc, args.argv)
    t0 = time.perf_counter()
    with single_process_group():
        profile = profile_rank(opts)
    save_profile(profile, args.out)
    print(f"profile: {profile.num_requests} requests, {profile.num_tokens} tokens, {profile.num_layers} MoE "
          f"layers x {profile.num_experts} experts (top-{profile.top_k}), "
          f"{profile.meta.get('vocab_extended', 0)} unseen tokens mapped by embedding nearest neighbour, "
          f"{time.perf_counter() - t0:.1f}s -> {args.out}")  # fmt: skip
    return 0


# ------------------------------------------------------------------------------------------- apply


def _configure_apply(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", required=True, help="checkpoint to place (save dir or iter_N dir)")
    p.add_argument("--tables", required=True, help="tables directory (from solve)")
    p.add_argument("--out", required=True, help="new checkpoint directory (must not exist)")
    p.add_argument("--seed", type=int, default=1234)


@command("apply", "permute a checkpoint's experts and router rows by a placement (new checkpoint)", _configure_apply)
def _apply(args: argparse.Namespace) -> int:
    _quiet()
    from .apply import apply_placement, validate_apply

    validate_apply(args.load, args.tables, args.out)
    t0 = time.perf_counter()
    final = apply_placement(args.load, args.tables, args.out, seed=args.seed)
    print(f"placed checkpoint ({time.perf_counter() - t0:.1f}s) -> {final}")
    return 0


# --------------------------------------------------------------------------------------------- lar


def _configure_lar(p: argparse.ArgumentParser) -> None:
    _add_run_arguments(p)
    p.add_argument("--tables", required=True, help="tables applied to --load (contiguous: an unplaced checkpoint)")
    p.add_argument("--mode", choices=["dp", "tp"], default="dp",
                   help="attention deployment mode: dp (TP = 1, Algorithm 2 for scheduled tables) or tp (TP = EP = "
                        "the tables' D as served, Algorithm 3 for scheduled tables)")
    p.add_argument("--profile", default=None,
                   help="optional profile of the same prompts (original model): also print evaluate's prediction")
    p.add_argument("--out", default=None, help="JSON result (default: print only)")


def _lar_table(rows: list[dict]) -> None:
    print(f"{'':<10}{'method':<12}{'mode':<6}{'EP':>4}{'LAR':>8}{'p25':>8}{'p50':>8}{'p75':>8}{'remote':>10}")
    for name, r in rows:
        print(f"{name:<10}{r['method']:<12}{r['mode']:<6}{r['num_devices']:>4}{r['lar']:>8.4f}{r['lar_p25']:>8.4f}"
              f"{r['lar_p50']:>8.4f}{r['lar_p75']:>8.4f}{r['remote_activations']:>10}")


@command("lar", "measure the local activation rate of a placed checkpoint in a real forward", _configure_lar)
def _lar(args: argparse.Namespace) -> int:
    _quiet()
    from moe_variants.semmoe.placement import check_tables_match_checkpoint
    from .model_run import lar_rank
    from megatron.components.parallel import single_process_group

    from megatron.common import collectives

    from .runtime import in_torchrun, run_under_torchrun
    from moe_variants.semmoe.tables import load_tables

    tables = load_tables(args.tables)
    args.expert_model_parallel_size = tables.num_devices
    args.tensor_model_parallel_size = tables.num_devices if args.mode == "tp" else 1  # tp: the served layout
    opts = _run_options(args)
    if in_torchrun():
        result = lar_rank(opts, args.tables, args.mode)
        # rank 0 reports alone (a --profile of other prompts is found here): the others wait for its outcome
        collectives.agreed(lambda: _report_lar(args, tables, result, atomic_write), src=0)
        _finish_rank()
        return 0
    if args.out:
        _check_output_file(args.out)
    _, manifest = _check_run_inputs(args, tables.num_devices)
    check_tables_match_checkpoint(tables, manifest, args.tables, args.load)
    if args.profile:
        from moe_variants.semmoe.profile import load_profile

        load_profile(args.profile)
    if tables.num_devices > 1:
        return run_under_torchrun(tables.num_devices, args.argv)
    with single_process_group():
        result = lar_rank(opts, args.tables, args.mode)
    _report_lar(args, tables, result, atomic_write)
    return 0


def _requests_of(profile, request_ids: list, path: str):
    """The profile's requests with these ids, in this order (a ``--limit`` run measures a prefix)."""
    ids = profile.meta.get("request_ids")
    if ids == request_ids:
        return profile
    index = {r: i for i, r in enumerate(ids or [])}
    missing = [r for r in request_ids if r not in index]
    if ids is None:
        raise UserError(f"--profile {path} records no request ids; profile the same prompts file")
    if missing:
        raise UserError(f"--profile {path} lacks {len(missing)} of the measured prompts (e.g. id {missing[0]!r})")
    import numpy as np

    return profile.select_requests(np.array([index[r] for r in request_ids]))


def _report_lar(args, tables, result: dict, atomic_write) -> None:
    rows = [("measured", result)]
    if args.profile:
        from moe_variants.semmoe.metrics import evaluate
        from moe_variants.semmoe.profile import load_profile

        held = _requests_of(load_profile(args.profile), result["request_ids"], args.profile)
        predicted = evaluate(tables, held, args.mode, result.get("hidden_size"), 2, 0).to_dict()
        result["predicted"] = predicted
        rows.append(("predicted", predicted))
    _lar_table(rows)
    print(f"dispatch rows sent (all forwarded tokens, pads included): {result['dispatch_rows']}; "
          f"remote rows seen by the routers: {result['observed_remote_rows_all_tokens']}")
    if args.out:
        atomic_write(args.out, lambda f: json.dump(result, f, indent=2), mode="w")
        print(f"wrote {args.out}")
    sys.stdout.flush()
