"""``python -m tools.semmoe compare``: placements side by side on held-out requests, over seeds.

Each run (one per ``--seeds`` value) splits ``--profile`` into a part to solve on and a held-out
part (``split_profile(profile, --fraction, seed)``; with ``--heldout`` the parts are given and the
seed only reaches the solvers), places the experts with every ``--methods`` entry (seed = the
run's) and evaluates each placement on the held-out part in both deployment modes: attention-DP
(Algorithm 2 for scheduled tables, round-robin otherwise) and attention-TP (Algorithm 3, or
contiguous slices). ``--scheduled`` methods are evaluated a second time with Sem-MoE's token and
sequence tables built from their placement (``methods.with_schedule``), which compares placements
under the same scheduling.

Reported per (placement, mode): LAR, load imbalance (max / mean activations per device, mean over
layers, and the worst layer), dispatch bytes per held-out token over all MoE layers as this
stack's dispatcher sends them (one copy per remote (token, expert) pair) and as a dispatcher that
sends a token once per destination device would (DeepEP). The point is the median over the runs,
the interval the range (min-max) of the runs.
"""

from __future__ import annotations

import argparse

import numpy as np

from megatron.common.cli import UserError, int_list, positive_int
from megatron.common.files import write_json

from .commands import command

__all__ = ["METRICS"]

# (key, column, format): the figures compared, per held-out token where they are bytes
METRICS = (
    ("lar", "LAR", "{:.3f}"),
    ("peak_to_mean", "max/mean", "{:.3f}"),
    ("peak_to_mean_max", "worst layer", "{:.3f}"),
    ("bytes_per_token", "B/token pairs", "{:,.0f}"),
    ("bytes_per_token_per_device", "B/token per device", "{:,.0f}"),
)
_SCHEDULING = {  # (scheduled tables, mode) -> how tokens are placed
    (True, "dp"): "Algorithm 2",
    (True, "tp"): "Algorithm 3",
    (False, "dp"): "round-robin",
    (False, "tp"): "contiguous slices",
}


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="profile .npz: split per run, or solved on whole with --heldout")
    p.add_argument("--heldout", default=None, help="held-out profile .npz (default: split --profile per run)")
    p.add_argument("--expert-model-parallel-size", "--ep", dest="ep", metavar="D", type=positive_int, required=True)
    p.add_argument("--fraction", type=float, default=0.2, help="share of requests solved on (paper: 0.2)")
    p.add_argument("--seeds", type=int_list, default=[0, 1, 2], help="one run per seed (default 0,1,2)")
    p.add_argument("--methods", type=_names, default=["contiguous", "eplb", "affinity-eplb", "semmoe"])
    p.add_argument("--scheduled", type=_names, default=["affinity-eplb"],
                   help="placements also evaluated with Sem-MoE's token tables built for them ('' for none)")
    p.add_argument("--mode", choices=["dp", "tp", "both"], default="both", help="attention deployment mode")
    p.add_argument("--balance-slack", type=float, default=None,
                   help="load slack of semmoe's overload term and affinity-eplb's cap (default: the solver's)")
    p.add_argument("--hidden-size", type=positive_int, default=None, help="default: the profile's meta hidden_size")
    p.add_argument("--bytes-per-element", type=positive_int, default=2, help="activation element size (bf16: 2)")
    p.add_argument("--tp-batch-tokens", type=int, default=0, help="TP mode batches (0: one request per batch)")
    p.add_argument("--out", required=True, help="JSON to write")


def _check(args, methods: dict) -> None:
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        raise UserError(f"--seeds must name distinct seeds, got {args.seeds}")
    for flag, names in (("--methods", args.methods), ("--scheduled", args.scheduled)):
        unknown = [m for m in names if m not in methods]
        if unknown:
            raise UserError(f"{flag}: unknown method(s) {', '.join(unknown)}; "
                             f"choose from {', '.join(sorted(methods))}")
    if not args.methods:
        raise UserError("--methods is empty")
    if args.heldout is None and not 0.0 < args.fraction < 1.0:
        raise UserError(f"--fraction must be in (0, 1), got {args.fraction}")


def _run_figures(result, num_tokens: int) -> dict:
    return {
        "lar": result.lar, "lar_p50": result.lar_p50,
        "peak_to_mean": result.peak_to_mean, "peak_to_mean_max": result.peak_to_mean_max,
        "imbalance_mean": result.imbalance_mean, "imbalance_max": result.imbalance_max,
        "bytes_per_token": result.a2a_bytes / num_tokens,
        "bytes_per_token_per_device": result.a2a_bytes_per_device / num_tokens,
    }  # fmt: skip


def _summary(runs: list[dict]) -> dict:
    """Each figure's median, min and max over the runs."""
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = {"median": float(np.median(values)), "min": float(np.min(values)), "max": float(np.max(values))}
    return out


@command("compare", "placements side by side on held-out requests over seeds: LAR, imbalance, bytes", _configure)
def _compare(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from moe_variants.semmoe.methods import METHODS, place, with_schedule
    from moe_variants.semmoe.metrics import evaluate
    from moe_variants.semmoe.profile import load_profile, split_profile
    from moe_variants.semmoe.solver import SolverConfig

    _check(args, METHODS)
    profile = load_profile(args.profile)
    heldout = load_profile(args.heldout) if args.heldout else None
    if profile.num_experts % args.ep:
        raise UserError(f"--ep {args.ep} must divide the number of experts ({profile.num_experts})")
    hidden = args.hidden_size or profile.meta.get("hidden_size")
    if not hidden:
        raise UserError("--hidden-size is required: the profile does not record the model's hidden size")
    config = SolverConfig() if args.balance_slack is None else replace(SolverConfig(), balance_slack=args.balance_slack)
    modes = ["dp", "tp"] if args.mode == "both" else [args.mode]
    placements = [(m, False) for m in args.methods] + [(m, True) for m in args.scheduled]
    figures: dict = {}
    for seed in args.seeds:
        part, held = (profile, heldout) if heldout is not None else split_profile(profile, args.fraction, seed)
        for method, add_schedule in placements:
            tables = place(method, part, args.ep, seed, config)
            if add_schedule:
                if tables.has_schedule:
                    raise UserError(f"--scheduled {method}: the method schedules tokens itself")
                tables = with_schedule(tables, part, config.lookback)
            for mode in modes:
                r = evaluate(tables, held, mode, int(hidden), args.bytes_per_element, args.tp_batch_tokens)
                key = (method + ("+schedule" if add_schedule else ""), mode, tables.has_schedule)
                figures.setdefault(key, []).append({"seed": seed, "heldout_tokens": held.num_tokens,
                                                    **_run_figures(r, held.num_tokens)})  # fmt: skip
    n = len(args.seeds)
    rows = []
    for (label, mode, scheduled), runs in figures.items():
        figs = [{k: v for k, v in r.items() if k not in ("seed", "heldout_tokens")} for r in runs]
        rows.append({"placement": label, "mode": mode, "scheduling": _SCHEDULING[(scheduled, mode)],
                     "runs": runs, "summary": _summary(figs)})  # fmt: skip
    interval = f"range of {n} runs"
    print(f"EP = {args.ep}, held-out requests; median [{interval}] (seeds {','.join(map(str, args.seeds))})")
    print(f"{'placement':<26}{'mode':<6}{'scheduling':<19}" + "".join(f"{c:>26}" for _, c, _ in METRICS))
    for row in rows:
        cells = []
        for key, _, fmt in METRICS:
            s = row["summary"][key]
            cells.append(f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]")
        print(f"{row['placement']:<26}{row['mode']:<6}{row['scheduling']:<19}" + "".join(f"{c:>26}" for c in cells))
    payload = {
        "profile": str(args.profile), "heldout": args.heldout, "fraction": None if args.heldout else args.fraction,
        "num_devices": args.ep, "seeds": args.seeds, "hidden_size": int(hidden),
        "bytes_per_element": args.bytes_per_element, "tp_batch_tokens": args.tp_batch_tokens,
        "balance_slack": config.balance_slack,
        "point": "median", "interval": interval,
        "units": {"bytes_per_token": "dispatch bytes per held-out token over all MoE layers, one copy per remote "
                                     "(token, expert) pair",
                  "bytes_per_token_per_device": "the same, one copy per distinct remote device of the token's "
                                                "experts (a deduplicating dispatcher)",
                  "peak_to_mean": "max / mean activations per device, mean over layers (peak_to_mean_max: worst)",
                  "imbalance_mean": "max / median activations per device, mean over layers"},
        "rows": rows,
    }  # fmt: skip
    write_json(args.out, payload, indent=2)
    print(f"wrote {args.out}")
    return 0
