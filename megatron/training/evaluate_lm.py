"""Benchmark a checkpoint with lm-evaluation-harness, on one process or under torchrun with TP/EP.

    torchrun --nproc_per_node=N -m megatron.training.evaluate_lm --load CKPT --tasks T1,T2 \\
        [--limit K] [--include-path DIR] [--data-dir DIR] [--num-fewshot K] [--batch-size B] \\
        [--tensor-model-parallel-size N --expert-model-parallel-size N] [--semmoe-tables TABLES] \\
        [--log-samples] --output results.json
    python -m megatron.training.evaluate_lm ...        (one process, TP = EP = 1)

``--semmoe-tables`` assigns requests to data-parallel ranks by Sem-MoE's Algorithm 2 (docs/design/semmoe.md);
with or without it the output's ``moe`` section reports the local activation rate, the requests per
rank and the all-to-all bytes sent off-rank.

The offline tasks in ``examples/lm_eval_tasks`` (``local_arc_easy``, ..., tag ``local_eval``) read
the evaluation files under ``--data-dir`` (the layout of ``../shared/data``): pass
``--include-path examples/lm_eval_tasks --data-dir ../shared/data``. Without ``--include-path`` the
standard lm-eval (hub) tasks are available by their usual names (``--tasks arc_easy``).

Every rank runs the same evaluation (see ``lm_eval_adapter`` for how ranks share the work and stay
in lockstep); rank 0 prints the table and writes ``--output`` atomically (temporary file, then
rename). Bad input (missing, corrupt or unsafe checkpoint, unknown task, missing data directory,
existing output, lm-eval not installed) is a one-line ``evaluate_lm: error: ...`` with exit status 2, and
nothing is written.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Optional

from moe_variants import registry
from megatron.components.checkpointing import CheckpointError
from megatron.common.cli import ArgumentParser, UserError, run_cli, user_input
from megatron.common.files import refuse_existing, write_json
from megatron.common import collectives
from moe_variants.common.moe_layer import comm_totals, reset_comm_counters

__all__ = ["build_parser", "main", "check_inputs", "load_tasks", "write_json_atomic"]

INSTALL_HINT = 'lm-eval is not installed: pip install -e ".[eval]"'


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m megatron.training.evaluate_lm",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory (a run's save dir or one iter_ dir)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task, group or tag names")
    p.add_argument("--output", required=True, help="results JSON (written atomically by rank 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--limit", type=float, default=None,
                   help="documents per task (an integer), or a fraction of each task if < 1")
    p.add_argument("--include-path", default=None, help="extra directory of task YAMLs")
    p.add_argument("--data-dir", default=None,
                   help="root of the local evaluation files read by the offline tasks (../shared/data)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    p.add_argument("--max-gen-toks", type=int, default=256,
                   help="generation budget for requests that do not set one")
    p.add_argument("--generation", choices=["auto", "kv_cache", "recompute"], default="auto",
                   help="how greedy generation computes each step (auto: KV cache where supported)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--bootstrap-iters", type=int, default=100000,
                   help="bootstrap resamples for the standard errors of non-mean metrics (0: none)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-samples", action="store_true",
                   help="also write lm-eval's per-document samples (requests, log-likelihoods, metrics) under "
                        "'samples' in --output")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens the model reads at once (default: the checkpoint's seq_length); lm-eval's API "
                        "models keep two tokens back: --max-length L-2 scores as local-completions with max_length=L")
    registry.add_runtime_arguments(p)  # e.g. Sem-MoE's --semmoe-tables
    return p


def write_json_atomic(path: str, payload: dict, *, overwrite: bool = False) -> None:
    """Write the results JSON atomically; refuse an existing file unless ``overwrite``."""
    from lm_eval.utils import handle_non_serializable

    refuse_existing(path, "--output", overwrite)
    write_json(path, payload, default=handle_non_serializable)


class _DropCustomDatasetNotice(logging.Filter):
    """lm-eval warns on every task with a ``custom_dataset`` that kwargs can be passed with
    ``--metadata``; evaluate_lm passes ``data_dir`` that way itself."""

    def filter(self, record):
        return "Custom kwargs can be passed" not in record.getMessage()


logging.getLogger("lm_eval.api.task").addFilter(_DropCustomDatasetNotice())


def task_list(spec: str) -> list[str]:
    tasks = [t.strip() for t in spec.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks: no task names given")
    return tasks


def task_manager(args, tasks: list[str]):
    """lm-eval's TaskManager with ``data_dir`` in every task's metadata. Indexing lm-eval's own
    ~15k task configs takes seconds to a minute, so when every requested task is in
    ``--include-path`` only that directory is indexed."""
    from lm_eval.tasks import TaskManager

    metadata = {"data_dir": os.path.abspath(args.data_dir)} if args.data_dir else None
    if args.include_path:
        local = TaskManager(include_path=args.include_path, include_defaults=False, metadata=metadata)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=args.include_path, metadata=metadata)


def check_inputs(args) -> "object":
    """Validate everything that can be checked before loading a model; returns the TaskManager.

    Raises ``ValueError`` with a one-line message naming the flag.
    """
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    from megatron.components.checkpointing import CheckpointError, find_latest_checkpoint

    try:
        if find_latest_checkpoint(args.load) is None:
            raise ValueError(f"--load {args.load}: no complete checkpoint found")
    except CheckpointError as err:
        raise ValueError(str(err)) from None
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise ValueError(f"--output {args.output}: directory {out_dir} does not exist")
    if os.path.exists(args.output) and not args.overwrite:
        raise ValueError(f"--output {args.output} exists (pass --overwrite to replace it)")
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise ValueError(f"--include-path {args.include_path}: no such directory")
    if args.data_dir is not None and not os.path.isdir(args.data_dir):
        raise ValueError(f"--data-dir {args.data_dir}: no such directory")
    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit must be > 0, got {args.limit:g}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    from megatron.components.checkpointing import read_manifest

    # a variant's request scheduler checks its inputs before any rank loads the model: the world is
    # torchrun's (1 for a plain python -m)
    manifest = read_manifest(find_latest_checkpoint(args.load), verify=False)
    registry.check_runtime(args, registry.Application.EVALUATE_LM)
    registry.request_scheduler(args, manifest, int(os.environ.get("WORLD_SIZE", "1")))
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")

    tasks = task_list(args.tasks)
    manager = task_manager(args, tasks)
    known = set(manager.all_tasks)
    for name in tasks:
        if name not in known:
            hint = "" if args.include_path else " (the offline local_* tasks need --include-path examples/lm_eval_tasks)"
            raise ValueError(f"--tasks: unknown task {name!r}{hint}")
    # build the tasks once now (their data loads here) so that a missing file fails before the model loads
    load_tasks(manager, tasks, flag=f"--tasks {args.tasks}")
    return manager


def load_tasks(manager, tasks: list[str], *, flag: str) -> dict:
    """Build ``tasks`` (their data loads here); returns ``{name: Task}`` of the leaf tasks. A missing
    or unreadable data file is a one-line ``ValueError`` starting with ``flag``."""
    try:
        if hasattr(manager, "load"):  # lm-eval >= 0.4.10
            loaded = manager.load(tasks)["tasks"]
        else:
            from lm_eval.tasks import get_task_dict

            loaded = get_task_dict(tasks, manager)
    except (OSError, ValueError) as err:
        raise ValueError(f"{flag}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    return {str(name): task for name, task in loaded.items()}


def _limit(value: Optional[float]):
    if value is None:
        return None
    return int(value) if value >= 1 else value


def _init_distributed(stack) -> None:
    """torchrun's environment, or a world of one gloo rank for a plain ``python -m``."""
    import torch.distributed as dist

    from megatron.components.parallel import destroy_parallel, init_from_env, single_process_group

    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init_from_env(timeout_minutes=30)
        stack.callback(destroy_parallel)
    else:
        stack.enter_context(single_process_group())


def evaluate(args, manager) -> dict:
    """Load the model at the requested layout and run lm-eval; returns the results payload."""
    import contextlib

    import lm_eval
    import torch.distributed as dist

    from megatron.components.checkpointing import find_latest_checkpoint, read_manifest
    from megatron.training.lm_eval_adapter import MegatronCheckpointLM

    with contextlib.ExitStack() as stack:
        _init_distributed(stack)
        rank = dist.get_rank()
        if rank != 0:
            logging.getLogger("lm_eval").setLevel(logging.ERROR)
        start = time.perf_counter()
        ckpt = find_latest_checkpoint(args.load)
        manifest = read_manifest(ckpt, verify=False)
        registry.check_runtime(args, registry.Application.EVALUATE_LM)
        scheduler = registry.request_scheduler(args, manifest, dist.get_world_size())
        lm = MegatronCheckpointLM.from_checkpoint(
            args.load, tensor_model_parallel_size=args.tensor_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size, seed=args.seed, max_length=args.max_length,
            batch_size=args.batch_size, max_gen_toks=args.max_gen_toks, generation=args.generation,
            request_scheduler=scheduler,
        )
        loaded = time.perf_counter()
        reset_comm_counters(lm.model)
        counter, no_lar = lar_counter(lm)
        with counter if counter is not None else contextlib.nullcontext():
            results = lm_eval.simple_evaluate(
                model=lm, tasks=task_list(args.tasks), num_fewshot=args.num_fewshot, limit=_limit(args.limit),
                task_manager=manager, log_samples=args.log_samples, bootstrap_iters=args.bootstrap_iters,
                random_seed=args.seed, numpy_random_seed=args.seed, torch_random_seed=args.seed,
                fewshot_random_seed=args.seed,
            )
        done = time.perf_counter()
        # lm-eval returns the results on local rank 0 only (its rule for TP launchers)
        results = results or {}
        moe = _moe_traffic(lm, scheduler)
        if counter is not None:
            moe.update(counter.summary())
        else:
            moe["lar"] = None
            moe["lar_not_counted"] = no_lar
        payload = {k: results[k] for k in ("results", "groups", "group_subtasks", "configs", "versions",
                                           "n-shot", "higher_is_better", "n-samples", "samples") if k in results}
        payload["model"] = {
            "checkpoint": os.path.abspath(ckpt),
            "iteration": manifest.get("iteration"),
            "world_size": dist.get_world_size(),
            "tensor_model_parallel_size": args.tensor_model_parallel_size,
            "expert_model_parallel_size": args.expert_model_parallel_size,
            "seq_length": lm.max_length,
            "batch_size": args.batch_size,
            "generation": lm.generation.value,
            "limit": _limit(args.limit),
            "num_fewshot": args.num_fewshot,
            "load_s": round(loaded - start, 3),
            "evaluate_s": round(done - loaded, 3),
        }
        payload["moe"] = moe
        if scheduler is not None:
            payload["moe"].update(scheduler.report())

        def write():
            with user_input(OSError):  # an unwritable --output
                write_json_atomic(args.output, payload, overwrite=args.overwrite)

        collectives.agreed(write, src=0)  # rank 0 writes; every rank exits with its outcome
        if rank == 0:
            from lm_eval.utils import make_table

            print(make_table(results))
            if results.get("groups"):
                print(make_table(results, "groups"))
            if moe.get("lar") is not None:
                print(f"local activation rate {moe['lar']:.4f} ({moe['request_scheduling']}, "
                      f"requests per rank {moe['requests_per_rank']})", flush=True)
            print(f"wrote {args.output} (load {payload['model']['load_s']:.1f}s, "
                  f"evaluate {payload['model']['evaluate_s']:.1f}s)", flush=True)
    return payload


def lar_counter(lm):
    """(a ``LocalActivationCounter`` installed as ``lm``'s forward observer, None) or
    (None, why the local activation rate cannot be counted): it needs TP = 1 (a token lives on
    one rank), a dropless MoE and routers that report their routing."""
    import torch.distributed as dist

    if lm.pg_collection.tp.size() != 1:
        return None, "TP > 1 (sequence-parallel tokens live on several ranks)"
    if getattr(lm.model.config, "moe_expert_capacity_factor", None) is not None:
        return None, "the MoE drops tokens (moe_expert_capacity_factor)"
    from moe_variants.common.routing import LocalActivationCounter

    ep = lm.pg_collection.ep
    try:
        counter = LocalActivationCounter(lm.model, dist.get_rank(ep), dist.get_world_size(ep))
    except ValueError as err:
        return None, str(err)
    lm.forward_observer = counter.count
    return counter, None


def _moe_traffic(lm, scheduler) -> dict:
    """All-to-all bytes this evaluation sent to other ranks (summed over ranks) and the requests
    each data-parallel rank ran (collective: every rank calls it)."""
    import torch
    import torch.distributed as dist

    totals = comm_totals(lm.model)
    t = torch.tensor([totals["bytes_dispatch"], totals["bytes_combine"]], dtype=torch.float64)
    collectives.all_reduce(t)
    out = {"dispatch_bytes_off_rank": int(t[0]), "combine_bytes_off_rank": int(t[1]),
           "request_scheduling": scheduler.name if scheduler is not None else "round-robin",
           "requests_per_rank": list(lm._ranks.assigned)}
    return out


def main(argv=None) -> int:
    from megatron import compat

    from torch.distributed.checkpoint.api import CheckpointException

    compat.quiet_warnings()

    def body():
        args = build_parser().parse_args(argv)
        with user_input():
            manager = check_inputs(args)
        evaluate(args, manager)

    # a corrupt, unsafe or mismatched checkpoint is one line too (torch's CheckpointException is a BaseException)
    return run_cli("evaluate_lm", body, user_errors=(UserError, CheckpointError, CheckpointException))


if __name__ == "__main__":
    sys.exit(main())
