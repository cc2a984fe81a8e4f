"""A rank that takes injected faults: ``torchrun ... -m tools.faults.rank {pretrain_gpt,serve} ARGS``
runs ``megatron.training.pretrain_gpt`` (or ``megatron.inference.serve``) with ARGS, as
``-m megatron.training.pretrain_gpt ARGS`` would, after subscribing a ``tools.faults.inject``
``Injector`` to the loop's ``STEP_END`` event when ``$MEGATRON_FAULT_DIR`` is set. The fault
requests are read from that directory after every step, and once when a torchrun rank starts
(``inject.AT_START``: before it loads anything); nothing of this ships in the loops but the event.
``python -m tools.faults.rank serve --nproc-per-node N ARGS`` is the server's front end
process (``megatron.inference.launcher``) whose torchrun ranks run ``tools.faults.rank serve ARGS``.
"""

from __future__ import annotations

import os
import sys

from tools.faults.inject import AT_START, ENV, Injector

__all__ = ["main", "ENTRIES"]

ENTRIES = ("pretrain_gpt", "serve")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ENTRIES:
        print(f"usage: python -m tools.faults.rank {{{','.join(ENTRIES)}}} [--] ARGS...", file=sys.stderr)
        return 2
    entry, args = argv[0], argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if entry == "pretrain_gpt":
        from megatron.training import pretrain_gpt as module
        from megatron.training.training import STEP_END
    else:
        from megatron.inference import serve as module
        from megatron.inference.loop import STEP_END
    directory = os.environ.get(ENV)
    if directory:
        injector = Injector(directory, int(os.environ.get("RANK", "0")))
        if "RANK" in os.environ:  # a torchrun rank (not the front end process of --nproc-per-node)
            injector(AT_START)
        STEP_END.subscribe(injector)
    if entry == "serve":  # with --nproc-per-node, the front end starts its ranks through this module too
        return module.main(args, rank_command=("tools.faults.rank", "serve"))
    return module.main(args)


if __name__ == "__main__":
    sys.exit(main())
