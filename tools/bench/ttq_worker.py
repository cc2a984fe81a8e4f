"""Time-to-quality worker: one variant's pretraining run, resumable, inside the benchmark's namespaces.

``python -m tools.bench.ttq_worker SPEC.json`` (started once per rank by ``scripts/time_to_quality.py``
through the benchmark launcher). It builds the configs exactly as the EP benchmark's model worker
does (``--config``, overrides, the variant's preset, EP = the number of ranks, the seed) and runs
the project's pretraining loop (``megatron.training.pretrain_gpt.run_pretraining``) with:

* ``--save`` and ``--load`` = ``options["save_dir"]``: a rerun resumes from the last checkpoint;
* ``--train-iters`` = ``options["steps"]``, ``--eval-interval``/``--save-interval`` =
  ``options["eval_interval"]``, ``--eval-iters`` = ``options["eval_iters"]``;
* ``--log-interval 1``: every step's time is in ``SAVE/metrics.jsonl``, so the training clock can be
  rebuilt from the file after any number of interruptions (``tools.bench.ttq.load_curve``);
* no held-out text at the end (not part of the curve).

Each rank writes ``{"rank", "world_size", "variant", "summary"}`` to ``spec.result_path(rank)``.
"""

from __future__ import annotations

import sys

from megatron import compat

from megatron.common.cli import run_cli, user_input
from megatron.common.files import write_json

from .schema import WorkerSpec
from .variant_worker import worker_configs
from .worker_env import init_gloo_from_env, rank_and_world, read_spec_from_argv

__all__ = ["configs_for", "main"]


def configs_for(spec: WorkerSpec, world: int):
    """The pretraining configs of one time-to-quality run (see the module docstring)."""
    o = spec.options
    return worker_configs(spec, world, fixed=dict(
        train_iters=o["steps"], eval_interval=o["eval_interval"], eval_iters=o["eval_iters"],
        save_interval=o["eval_interval"], log_interval=1, save=o["save_dir"], load=o["save_dir"],
        heldout_text=None, keep_last_checkpoints=1,
    ))  # fmt: skip


def main(argv=None) -> int:
    compat.quiet_warnings()
    spec = read_spec_from_argv(argv)
    init_gloo_from_env(spec.num_threads, timeout_s=1800.0)
    rank, world = rank_and_world()
    from megatron.training.pretrain_gpt import run_pretraining, user_errors

    def body():
        with user_input():
            configs = configs_for(spec, world)
        summary = run_pretraining(configs, prog="ttq_worker")
        write_json(spec.result_path(rank), {"rank": rank, "world_size": world, "variant": spec.variant,
                                            "summary": {k: v for k, v in summary.items() if k != "last_step"}})  # fmt: skip

    return run_cli("ttq_worker", body, user_errors=user_errors())


if __name__ == "__main__":
    sys.exit(main())
