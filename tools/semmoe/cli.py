"""``python -m tools.semmoe <command>``: Sem-MoE offline passes.

Commands are registered in ``commands.COMMANDS``; each gets an argparse sub-parser and a
``run(args)`` returning an exit code. User errors print one line and exit with status 2.

* ``solve``     profile -> tables for one placement method and EP size
* ``evaluate``  tables (one or more) x held-out profile -> LAR / imbalance / bytes table + JSON
* ``compare``   placements side by side on held-out requests over seeds (``compare.py``)
* ``export-costs`` a placement's per-rank traffic beside a network's per-EP-rank cost matrix
  (``moe-ep-cost/1`` JSON, ``export_costs.py``)
* ``synth``     write a synthetic profile with planted token-expert affinity
* ``split``     split a profile's requests into a profiling part and a held-out part
* ``stats``     routing statistics of profiles: Table 1 per layer, domain-expert mutual information
* ``profile``, ``apply``, ``lar``: the model-side commands (``model_commands.py``)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megatron.common.cli import UserError, positive_int, user_input
from megatron.common.files import write_json

from . import compare, export_costs, model_commands  # noqa: F401  (register their commands)
from .commands import COMMANDS, command

__all__ = ["main"]


# ------------------------------------------------------------------------------------------ solve


def _configure_solve(p: argparse.ArgumentParser) -> None:
    from moe_variants.semmoe.methods import METHODS
    from moe_variants.semmoe.solver import SolverConfig, TokenTable

    d = SolverConfig()
    p.add_argument("--profile", required=True, help="profile .npz (from `profile`, `synth` or `split`)")
    p.add_argument("--expert-model-parallel-size", "--ep", dest="ep", metavar="D", type=positive_int, required=True,
                   help="expert-parallel size D (must divide the experts); --ep is an alias")
    p.add_argument("--method", default="semmoe", choices=sorted(METHODS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="tables directory to write (refused if it exists)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--verbose", action="store_true", help="print per-layer objective terms (semmoe)")
    g = p.add_argument_group("Algorithm 1 (semmoe, milp)")
    g.add_argument("--n-steps", type=positive_int, default=d.n_steps)
    g.add_argument("--ft-steps", type=int, default=d.ft_steps)
    for name in ("alpha_e", "beta_e", "gamma_e", "alpha_r", "beta_r", "theta", "expert_balance", "balance_slack"):
        g.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    g.add_argument("--patience", type=positive_int, default=d.patience)
    g.add_argument("--lookback", type=positive_int, default=d.lookback)
    g.add_argument("--token-table", choices=[t.value for t in TokenTable], default=d.token_table.value)
    g.add_argument(
        "--polish", action=argparse.BooleanOptionalAction, default=d.polish, help="token-level descent (mass table)"
    )


@command("solve", "place experts and build scheduling tables from a profile", _configure_solve)
def _solve(args: argparse.Namespace) -> int:
    from moe_variants.semmoe.methods import place
    from moe_variants.semmoe.profile import load_profile
    from moe_variants.semmoe.solver import SolverConfig, solve
    from megatron.common.files import refuse_existing
    from moe_variants.semmoe.tables import save_tables

    refuse_existing(args.out, "--out", args.overwrite)
    profile = load_profile(args.profile)
    if profile.num_experts % args.ep:
        raise UserError(f"--expert-model-parallel-size {args.ep} must divide the number of experts "
                        f"({profile.num_experts})")
    with user_input():
        config = SolverConfig(
            n_steps=args.n_steps,
            ft_steps=args.ft_steps,
            alpha_e=args.alpha_e,
            beta_e=args.beta_e,
            gamma_e=args.gamma_e,
            alpha_r=args.alpha_r,
            beta_r=args.beta_r,
            theta=args.theta,
            expert_balance=args.expert_balance,
            balance_slack=args.balance_slack,
            patience=args.patience,
            lookback=args.lookback,
            token_table=args.token_table,
            polish=args.polish,
        )
    t0 = time.perf_counter()
    if args.method == "semmoe" and args.verbose:
        tables = solve(profile, args.ep, args.seed, config, log=print)
    else:
        tables = place(args.method, profile, args.ep, args.seed, config)
    elapsed = time.perf_counter() - t0
    tables.meta.setdefault("profile_path", str(args.profile))
    save_tables(tables, args.out)
    print(
        f"{args.method}: {profile.num_layers} layers x {profile.num_experts} experts on EP={args.ep}, "
        f"{profile.num_requests} requests / {profile.num_tokens} tokens, solved in {elapsed:.1f}s -> {args.out}"
    )
    return 0


# --------------------------------------------------------------------------------------- evaluate


def _configure_evaluate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", nargs="+", required=True, help="one or more tables directories")
    p.add_argument("--profile", required=True, help="held-out profile .npz")
    p.add_argument("--mode", choices=["dp", "tp", "both"], default="both", help="attention deployment mode")
    p.add_argument("--hidden-size", type=positive_int, default=None, help="default: the profile's meta hidden_size")
    p.add_argument("--bytes-per-element", type=positive_int, default=2, help="activation element size (bf16: 2)")
    p.add_argument(
        "--tp-batch-tokens",
        type=int,
        default=0,
        help="TP mode: pack requests into batches of this many tokens (0: one request per batch)",
    )
    p.add_argument("--split-ids", type=positive_int, default=None, metavar="F",
                   help="also report each domain (the first F ':'-fields of the request ids, e.g. 1: mbpp:<n>), "
                        "its requests served together with the others")  # fmt: skip
    p.add_argument("--out", default=None, help="JSON path (default: evaluation_<profile>.json in the first tables dir)")


def _domain_keys(profile, fields: int, name: str) -> list[str]:
    """Each request's domain: the first ``fields`` ':'-separated fields of its id."""
    ids = profile.meta.get("request_ids")
    if ids is None:
        raise UserError(f"--split-ids: profile {name} records no request ids")
    return [":".join(str(i).split(":")[:fields]) for i in ids]


@command("evaluate", "LAR, load imbalance and all-to-all bytes of tables on a held-out profile", _configure_evaluate)
def _evaluate(args: argparse.Namespace) -> int:
    import numpy as np

    from moe_variants.semmoe.metrics import evaluate
    from moe_variants.semmoe.profile import load_profile
    from moe_variants.semmoe.tables import load_tables

    profile = load_profile(args.profile)
    hidden = args.hidden_size or profile.meta.get("hidden_size")
    if not hidden:
        raise UserError("--hidden-size is required: the profile does not record the model's hidden size")
    modes = ["dp", "tp"] if args.mode == "both" else [args.mode]
    groups = None
    if args.split_ids:
        keys = np.array(_domain_keys(profile, args.split_ids, args.profile))
        groups = {d: np.flatnonzero(keys == d) for d in sorted(set(keys.tolist()))}
    rows = []
    for path in args.tables:
        tables = load_tables(path)
        for mode in modes:
            r = evaluate(tables, profile, mode, int(hidden), args.bytes_per_element, args.tp_batch_tokens, groups)
            rows.append({"tables": str(path), **r.to_dict()})
    w = max(12, *(len(r["method"]) + 1 for r in rows))  # affinity-eplb is 13 characters
    print(
        f"{'method':<{w}}{'mode':<6}{'EP':>4}{'LAR':>8}{'p25':>8}{'p50':>8}{'p75':>8}"
        f"{'imb.mean':>10}{'imb.max':>9}{'a2a GiB':>10}"
    )
    for r in rows:
        print(
            f"{r['method']:<{w}}{r['mode']:<6}{r['num_devices']:>4}{r['lar']:>8.3f}{r['lar_p25']:>8.3f}"
            f"{r['lar_p50']:>8.3f}{r['lar_p75']:>8.3f}{r['imbalance_mean']:>10.3f}{r['imbalance_max']:>9.3f}"
            f"{r['a2a_bytes'] / 2**30:>10.3f}"
        )
    if groups:
        print(f"\nper domain, served together: LAR (imbalance max over layers); {len(groups)} domains")
        print(f"{'method':<{w}}{'mode':<6}{'EP':>4}" + "".join(f"{d[:14]:>16}" for d in groups))
        for r in rows:
            cells = "".join(f"{g['lar']:>8.3f} ({g['imbalance_max']:>4.2f})" for g in r["by_group"].values())
            print(f"{r['method']:<{w}}{r['mode']:<6}{r['num_devices']:>4}{cells}")
    out = Path(args.out) if args.out else Path(args.tables[0]) / f"evaluation_{Path(args.profile).stem}.json"
    payload = {
        "profile": str(args.profile),
        "num_requests": profile.num_requests,
        "num_tokens": profile.num_tokens,
        "hidden_size": int(hidden),
        "bytes_per_element": args.bytes_per_element,
        "results": rows,
    }
    write_json(out, payload, indent=2)
    print(f"wrote {out}")
    return 0


# ------------------------------------------------------------------------------------------ stats


def _named_profile(text: str) -> tuple:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH")
    return name, path


def _configure_stats(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", type=_named_profile, action="append", required=True, metavar="NAME=PATH",
                   help="a profile of one domain's prompts (repeat: one per domain)")
    p.add_argument("--split-ids", type=positive_int, default=None, metavar="F",
                   help="also split each profile into domains by the first F ':'-fields of its request ids "
                        "(e.g. 2: mmlu:<subject>)")
    p.add_argument("--min-count", type=positive_int, default=5, help="Table 1: tokens seen at least this often")
    p.add_argument("--seed", type=int, default=0, help="the shuffled-label baseline's permutation")
    p.add_argument("--json", default=None, help="write the result here")


def _domain_information(groups: list, profiles: dict, seed: int) -> dict:
    """I(domain; expert) per layer for ``groups`` [(domain, profile name, request indices)], and the
    same with the domain labels shuffled over the requests (the finite-sample floor)."""
    import numpy as np

    from moe_variants.semmoe.routing_stats import domain_expert_information, expert_counts

    def per_layer(assign):
        counts = np.stack([sum(expert_counts(profiles[name], idx) for name, idx in parts) for parts in assign])
        return [domain_expert_information(counts[:, layer]) for layer in range(counts.shape[1])]

    real = per_layer([[(name, idx)] for _, name, idx in groups])
    rng = np.random.default_rng(seed)
    pooled = [(name, int(i)) for _, name, idx in groups for i in idx]
    order = rng.permutation(len(pooled))
    cuts = np.cumsum([len(idx) for _, _, idx in groups])[:-1]
    shuffled = []
    for chunk in np.split(order, cuts):
        by_name: dict = {}
        for j in chunk:
            by_name.setdefault(pooled[j][0], []).append(pooled[j][1])
        shuffled.append([(name, np.array(ix)) for name, ix in by_name.items()])
    return {"domains": [g for g, _, _ in groups], "requests": [int(len(idx)) for _, _, idx in groups],
            "per_layer": real, "shuffled_per_layer": per_layer(shuffled)}


@command("stats", "routing statistics: the paper's Table 1 and domain-expert mutual information", _configure_stats)
def _stats(args: argparse.Namespace) -> int:
    import numpy as np

    from moe_variants.semmoe.profile import load_profile
    from moe_variants.semmoe.routing_stats import activation_concentration

    profiles = {}
    for name, path in args.profile:
        if name in profiles:
            raise UserError(f"--profile {name}=...: the name {name!r} is given twice")
        profiles[name] = load_profile(path)
    shapes = {(p.num_layers, p.num_experts, p.top_k) for p in profiles.values()}
    if len(shapes) != 1:
        raise UserError(f"--profile: the profiles come from different routers (layers, experts, top-k: {sorted(shapes)})")
    result = {"min_count": args.min_count, "table1": {}, "information": {}}
    print(f"Table 1 (tokens seen >= {args.min_count} times; p25 / p50 / p75)")
    print(f"{'profile':<12}{'layer':>6}{'tokens':>8}  {'F1':<20}{'cum. hotness top-k':<22}{'max hotness rest':<20}")
    q = lambda d: f"{d['p25']:.3f} {d['p50']:.3f} {d['p75']:.3f}"  # noqa: E731
    for name, prof in profiles.items():
        rows = [activation_concentration(prof, layer, args.min_count) for layer in range(prof.num_layers)]
        result["table1"][name] = rows
        for r in rows:
            print(f"{name:<12}{r['layer']:>6}{r['tokens']:>8}  {q(r['f1']):<20}{q(r['cum_hotness_topk']):<22}"
                  f"{q(r['max_hotness_rest']):<20}")
    levels = {}
    if len(profiles) > 1:
        levels["profiles"] = [(name, name, np.arange(p.num_requests)) for name, p in profiles.items()]
    if args.split_ids:
        for name, prof in profiles.items():
            keys = _domain_keys(prof, args.split_ids, name)
            domains = sorted(set(keys))
            if len(domains) > 1 and prof.num_requests < 10 * len(domains):
                print(f"note: --split-ids {args.split_ids} gives profile {name} {len(domains)} domains for "
                      f"{prof.num_requests} requests (fewer than 10 each): not split")
            elif len(domains) > 1:
                levels[f"{name} by id"] = [(d, name, np.flatnonzero(np.array(keys) == d)) for d in domains]
    print("I(domain; expert) per layer, bits [shuffled-label floor]; normalised by H(domain)")
    for level, groups in levels.items():
        info = _domain_information(groups, profiles, args.seed)
        result["information"][level] = info
        cells = [f"{r['mutual_information_bits']:.4f} [{s['mutual_information_bits']:.4f}]"
                 for r, s in zip(info["per_layer"], info["shuffled_per_layer"])]
        h = info["per_layer"][0]["domain_entropy_bits"]
        print(f"{level} ({len(groups)} domains, H = {h:.3f} bits): " + ", ".join(cells))
    if args.json:
        write_json(args.json, result, indent=2)
        print(f"wrote {args.json}")
    return 0


# ------------------------------------------------------------------------------------------ synth


def _configure_synth(p: argparse.ArgumentParser) -> None:
    from moe_variants.semmoe.synthetic import SyntheticConfig

    d = SyntheticConfig()
    p.add_argument("--out", required=True, help="profile .npz to write")
    p.add_argument("--seed", type=int, default=0)
    for name, value in d.__dict__.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)


@command("synth", "write a synthetic profile with planted token-expert affinity", _configure_synth)
def _synth(args: argparse.Namespace) -> int:
    from moe_variants.semmoe.profile import save_profile
    from moe_variants.semmoe.synthetic import SyntheticConfig, synthetic_profile

    with user_input():
        cfg = SyntheticConfig(**{k: getattr(args, k) for k in SyntheticConfig().__dict__})
    profile = synthetic_profile(cfg, seed=args.seed)
    save_profile(profile, args.out)
    print(f"synthetic profile: {profile.num_requests} requests, {profile.num_tokens} tokens -> {args.out}")
    return 0


# ------------------------------------------------------------------------------------------ split


def _configure_split(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True)
    p.add_argument("--fraction", type=float, default=0.2, help="share of requests in the first part (paper: 0.2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="first part (to solve on)")
    p.add_argument("--heldout", required=True, help="second part (to evaluate on)")


@command("split", "split a profile's requests into profiling and held-out parts", _configure_split)
def _split(args: argparse.Namespace) -> int:
    from moe_variants.semmoe.profile import load_profile, save_profile, split_profile

    profile = load_profile(args.profile)
    with user_input():  # --fraction
        a, b = split_profile(profile, args.fraction, args.seed)
    save_profile(a, args.out)
    save_profile(b, args.heldout)
    print(f"{a.num_requests} requests -> {args.out}, {b.num_requests} requests -> {args.heldout}")
    return 0


# ------------------------------------------------------------------------------------------- main


def _user_errors() -> tuple:
    """UserError, and a corrupt or incomplete checkpoint's error once a model command has imported
    the checkpoint code (no other command can raise it: the table commands start without torch)."""
    checkpointing = sys.modules.get("megatron.components.checkpointing")
    return (UserError,) if checkpointing is None else (UserError, checkpointing.CheckpointError)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        from .runtime import rank_argv

        argv = sys.argv[1:] or rank_argv() or []
    argv = [str(a) for a in argv]

    def keep_argv(args):
        args.argv = argv  # commands that start torchrun re-run themselves with the same arguments

    return COMMANDS.main(argv, user_errors=_user_errors, prepare=keep_argv)
