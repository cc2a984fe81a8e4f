"""``python -m tools.faults {training,serving,serving-cases,chaos,serving-chaos} ...`` (see
``tools/faults/__init__.py``)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from megatron.common.cli import Subcommands, UserError, positive_float, positive_int
from megatron.common.files import write_json

import tools.faults

commands = Subcommands("python -m tools.faults", tools.faults.__doc__.split("\n\n")[0])


def _configure_training(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="DIR", help="where the runs and their logs go (default: a new temporary "
                   "directory, kept and printed)")
    p.add_argument("--cases", choices=("all", "ranks"), default="all",
                   help="ranks: only the rank faults under torchrun --max-restarts")


@commands.add("training", "faults in training on the tiny default, one line per case", _configure_training)
def _training(args) -> int:
    from tools.faults.training import run_cases

    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="fault_check."))
    print(f"python -m tools.faults training: runs and logs in {out}", flush=True)
    cases = run_cases(out, ranks_only=args.cases == "ranks", print_line=lambda line: print(line, flush=True))
    return 0 if all(c.ok for c in cases) else 1


def _configure_serving(p: argparse.ArgumentParser) -> None:
    from tools.faults.serving import FAULTS

    p.add_argument("--load", required=True, metavar="CKPT")
    p.add_argument("--faults", default="SIGSTOP,SIGKILL", help=f"comma-separated, of {', '.join(FAULTS)}")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--stall-timeout", type=positive_float, default=2.0)
    p.add_argument("--watchdog-timeout", type=positive_float, default=5.0)
    p.add_argument("--torchrun-shutdown-timeout", type=positive_int, default=5)
    p.add_argument("--json", metavar="PATH")


@commands.add("serving", "a fault in rank 1 of a two-rank expert-parallel server: how fast it is seen",
              _configure_serving)
def _serving(args) -> int:
    from tools.faults.serving import FAULTS, run_faults, summarize

    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    bad = [f for f in faults if f not in FAULTS]
    if bad or not faults:
        raise UserError(f"--faults: choose from {', '.join(FAULTS)} (got {args.faults})")
    if not os.path.isdir(args.load):
        raise UserError(f"--load {args.load}: no such directory")
    timeouts = dict(stall_timeout=args.stall_timeout, watchdog_timeout=args.watchdog_timeout,
                    torchrun_shutdown_timeout=args.torchrun_shutdown_timeout)
    runs = run_faults(os.path.abspath(args.load), faults, args.repeats, **timeouts)
    rows = summarize(runs, faults)
    if args.json:
        write_json(args.json, {"command": " ".join(["python -m tools.faults"] + sys.argv[1:]),
                               **{f"{k}_s": v for k, v in timeouts.items()}, "summary": rows, "runs": runs})
    return 0


def _configure_chaos(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", metavar="OUT")
    p.add_argument("--faults", type=positive_int, default=20)
    p.add_argument("--train-iters", type=positive_int, default=1500)
    p.add_argument("--save-interval", type=positive_int, default=20)
    p.add_argument("--gap", type=positive_float, nargs=2, default=(5.0, 25.0), metavar=("MIN", "MAX"),
                   help="seconds of progress before each fault (uniform)")
    p.add_argument("--heartbeat-timeout", type=positive_float, default=10.0)
    p.add_argument("--step-timeout", type=positive_float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-baseline", action="store_true", help="reuse OUT/baseline from an earlier run")


@commands.add("chaos", "random faults of every kind in one training run, against a fault-free run", _configure_chaos)
def _chaos(args) -> int:
    from tools.faults.chaos import chaos_run

    return chaos_run(args)


def _configure_serving_chaos(p: argparse.ArgumentParser) -> None:
    from tools.faults.serving_chaos import ChaosConfig, KINDS

    d = ChaosConfig("", "", "")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--load", required=True, metavar="CKPT")
    p.add_argument("--prompts", required=True, metavar="JSON",
                   help="ShareGPT JSON (or JSONL with 'text'), e.g. "
                        "../shared/data/prompts/sharegpt/ShareGPT_V3_filtered_500.json")
    p.add_argument("--faults", type=positive_int, default=d.faults)
    p.add_argument("--minutes", type=positive_float, default=d.minutes, help="of client load, per run")
    p.add_argument("--rate", type=positive_float, default=d.rate, help="requests/s (Poisson arrivals)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-output-len", type=positive_int, default=d.max_output_len)
    p.add_argument("--stream-fraction", type=float, default=d.stream_fraction)
    p.add_argument("--gap", type=positive_float, nargs=2, default=d.gap, metavar=("MIN", "MAX"),
                   help="seconds of service between the server answering again and the next fault (uniform)")
    p.add_argument("--stall-timeout", type=positive_float, default=d.stall_timeout)
    p.add_argument("--watchdog-timeout", type=positive_float, default=d.watchdog_timeout)
    p.add_argument("--client-timeout", type=positive_float, default=d.client_timeout,
                   help="seconds without a byte after which a client counts as hung")
    p.add_argument("--port", type=int, default=d.port,
                   help="the server's HTTP port, the same across its restarts (0: any free one)")
    p.add_argument("--skip-baseline", action="store_true", help="reuse OUT/baseline.json from an earlier run")


def _configure_serving_cases(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", required=True, metavar="CKPT", help="a standard checkpoint (the EP 2 and TP 2 runs)")
    p.add_argument("--mla-load", required=True, metavar="CKPT", help="an MLA checkpoint (the MLA EP 2 runs)")
    p.add_argument("--out", metavar="DIR", help="the servers' logs (default: a new temporary directory, kept)")
    p.add_argument("--runs", default=None, metavar="NAMES", help="comma-separated run names (default: all)")
    p.add_argument("--json", metavar="PATH", help="write the results here (schema serving_cases/1)")


@commands.add("serving-cases", "the serving end-to-end cases, one table of flag sets and faults, each checked "
              "against what users expect", _configure_serving_cases)
def _serving_cases(args) -> int:
    from tools.faults.serving_cases import TABLE, render_markdown, run_table

    names = None if args.runs is None else [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = sorted(set(names or ()) - {r.name for r in TABLE})
    if unknown:
        raise UserError(f"--runs: no run named {', '.join(unknown)} (choose from {', '.join(r.name for r in TABLE)})")
    for flag, path in (("--load", args.load), ("--mla-load", args.mla_load)):
        if not os.path.isdir(path):
            raise UserError(f"{flag} {path}: no such directory")
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="serving_cases."))
    print(f"python -m tools.faults serving-cases: logs in {out}", flush=True)
    result = run_table({"load": os.path.abspath(args.load), "mla_load": os.path.abspath(args.mla_load)}, out, names,
                       print_line=lambda line: print(line, flush=True))
    result["command"] = " ".join(["python -m tools.faults"] + sys.argv[1:])
    if args.json:
        write_json(args.json, result)
    print("\n" + render_markdown(result), flush=True)
    return 0 if all(c["ok"] for run in result["runs"] for c in run["cases"]) else 1


@commands.add("serving-chaos", "random faults of every kind in a server under client load, against a fault-free run",
              _configure_serving_chaos)
def _serving_chaos(args) -> int:
    from tools.faults.serving_chaos import ChaosConfig, KINDS, serving_chaos

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"--kinds: choose from {', '.join(KINDS)} (got {args.kinds})")
    if not 0 <= args.stream_fraction <= 1:
        raise ValueError(f"--stream-fraction must be in [0, 1], got {args.stream_fraction}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.gap[0] > args.gap[1]:
        raise ValueError(f"--gap: MIN {args.gap[0]:g} is above MAX {args.gap[1]:g}")
    for flag, path in (("--load", args.load), ("--prompts", args.prompts)):
        if not os.path.exists(path):
            raise ValueError(f"{flag} {path}: no such file or directory")
    return serving_chaos(ChaosConfig(
        out=os.path.abspath(args.out), load=os.path.abspath(args.load), prompts=os.path.abspath(args.prompts),
        faults=args.faults, minutes=args.minutes, rate=args.rate, kinds=kinds, seed=args.seed,
        max_output_len=args.max_output_len, stream_fraction=args.stream_fraction, gap=tuple(args.gap),
        stall_timeout=args.stall_timeout, watchdog_timeout=args.watchdog_timeout, client_timeout=args.client_timeout,
        port=args.port, skip_baseline=args.skip_baseline))


if __name__ == "__main__":
    sys.exit(commands.main(sys.argv[1:]))
