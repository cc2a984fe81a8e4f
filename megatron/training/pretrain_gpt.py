"""Pretrain a GPT MoE with megatron-core: ``torchrun --nproc_per_node=N -m megatron.training.pretrain_gpt``.

Megatron-LM's flag names (``--num-layers --hidden-size --num-experts --moe-router-topk ...
--data-path --split --save --load``), optionally from ``--config FILE.yaml`` (flags override it).
Without ``--data-path`` it trains on the embedded tiny-shakespeare corpus with the embedded BPE.

    torchrun --nproc_per_node=2 -m megatron.training.pretrain_gpt --config examples/tiny_moe_cpu.yaml

Per ``--log-interval`` rank 0 prints a line (with elapsed time and ETA) and appends a JSON object
to ``SAVE/metrics.jsonl`` (``--metrics-file``); validation loss/perplexity every
``--eval-interval``; checkpoints every ``--save-interval`` and at the end; the resolved
configuration goes to ``SAVE/config.yaml`` (``--print-config`` prints it too).

Resuming: ``--save DIR --load DIR`` continues from DIR's newest checkpoint, or starts from scratch
when there is none yet. A ``--save`` directory holding another run's checkpoints is refused at
start-up (``--load`` it, use a new ``--save``, or ``--overwrite-save``); one run writes to a
directory at a time (``SAVE/writer.lock``).

SIGTERM/SIGINT (to torchrun or to the ranks) finish the current step, save a checkpoint and exit.
A watchdog (``megatron/training/watchdog.py``) ends the job when a rank stops beating
(``--heartbeat-timeout``, 30 s) or no step finishes (``--step-timeout``, 180 s), or as soon as a
rank fails; with ``torchrun --max-restarts N`` and ``--save D --load D`` the job resumes by itself.
Exit codes: 0 finished, 75 stopped by a signal after saving (run again to resume), 2 bad input
(one line), 3 ended by the watchdog (a rank lost, hung or failed elsewhere), 1 a crash on this rank
(its traceback, also in torchrun's error file).
"""

from __future__ import annotations

import logging
import sys
from typing import Callable, Optional

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from megatron import compat
from megatron.components.arguments import Configs, parse_configs
from megatron.components.parallel import destroy_parallel
from megatron.training.training import Trainer, TrainerHooks
from megatron.common.cli import UserError, run_cli, user_input
from megatron.common.process import EXIT_CRASH, EXIT_PREEMPTED, record_failure

logger = logging.getLogger("megatron.training")

__all__ = ["main", "run_pretraining", "user_errors", "Trainer", "TrainerHooks"]


def run_pretraining(
    c: Configs,
    *,
    prog: str = "pretrain_gpt",
    forward_step_factory: Optional[Callable] = None,
    evaluate_hook: Optional[Callable] = None,
    after_setup: Optional[Callable] = None,
    before_wrap: Optional[Callable] = None,
    lineage: Optional[str] = None,
) -> dict:
    """``Trainer(c, ...).run()`` with the hooks as keywords (``TrainerHooks`` says what each does).
    Returns the final summary; its ``interrupted`` entry is true when a signal stopped the run."""
    hooks = TrainerHooks(forward_step_factory=forward_step_factory, evaluate=evaluate_hook,
                         after_setup=after_setup, before_wrap=before_wrap)
    return Trainer(c, prog=prog, hooks=hooks, lineage=lineage).run()


@record  # anything but bad input: the traceback goes into torchrun's error file too
def main(argv=None, prog: str = "pretrain_gpt") -> int:
    compat.quiet_warnings()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    def body():
        with user_input():
            configs = parse_configs(argv, prog=prog, description=__doc__)
        try:
            summary = run_pretraining(configs, prog=prog)
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, without saving
            print(f"{prog}: interrupted", file=sys.stderr, flush=True)
            return 130
        except dist.DistBackendError as e:  # a peer rank died or hung past --distributed-timeout-minutes
            line = f"{prog}: error: lost contact with another rank ({str(e).strip().splitlines()[0]})"
            record_failure(line)
            print(line, file=sys.stderr, flush=True)
            return EXIT_CRASH
        return EXIT_PREEMPTED if summary["interrupted"] else 0

    return run_cli(prog, body, user_errors=user_errors(), cleanup=destroy_parallel)


def user_errors() -> tuple:
    """The exceptions the training entry points report as one line (exit 2): bad input, and
    checkpoints that cannot be read or written (``CheckpointError`` names the file and the cause,
    e.g. a full disk). Anything else, a ``ValueError`` from inside a step included, keeps its
    traceback."""
    from megatron.components.checkpointing import CheckpointError

    return (UserError, CheckpointError)


if __name__ == "__main__":
    sys.exit(main())
