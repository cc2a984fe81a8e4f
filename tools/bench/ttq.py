"""``scripts/time_to_quality.py``: validation perplexity against training wall-clock on the shaped link.

BigMac's Fig. 1 question: on the same link, how long does each variant train before it reaches the
best validation perplexity the standard model reaches? (The paper: BigMac 1.71x faster.) Steps:

1. **Link**: the EP benchmark's namespaces and rate search (``tools.bench.netns``, ``tools.bench.tune``):
   short probes of ``standard`` with the benchmark's model worker choose the rate at which standard
   spends ``--target-comm-fraction`` of its step in all-to-all (or ``--link-gbit`` is taken as it
   is). The rate is stored in ``OUT/link.json`` and reused by every later invocation, so a resumed
   run trains on the same link.
2. **Training**: each variant is a pretraining run of the project's loop in the namespaces
   (``tools.bench.ttq_worker``), ``--steps`` steps, validation perplexity every ``--eval-interval``
   steps (the same validation batches every time), a checkpoint at each evaluation in
   ``OUT/<variant>/``. A run whose ``metrics.jsonl`` ends with a summary is done; an interrupted
   one resumes from its last checkpoint when the command is run again.
3. **Curves** (pure functions below, tested on synthetic curves): the training clock of a variant is
   the sum of its step times (rank 0, every step logged; evaluation, checkpointing and start-up
   excluded, so interruptions do not move it; a step repeated after a resume counts once, its
   last run). The target is the lowest validation perplexity ``standard`` reaches; each variant's
   time to target is the clock at which its curve first reaches it (linear interpolation between
   the two evaluations around the crossing), and its speed-up is standard's time / its time.

4. **Runs** (``--runs N``, default 3): the whole comparison is trained N times with the same seed
   (the curves repeat; the clocks measure the machine), the variant order rotated by one each run.
   Run 1 lives in ``OUT/<variant>/``, run k > 1 in ``OUT/run<k>/<variant>/``; each is resumable on its
   own. Every run is summarized against its own standard; the time to target, the speed-ups, the
   step time and the all-to-all share are then given as medians over the runs with their range, or
   at 5 runs or more a 95% bootstrap interval (``tools.bench.discipline``).

Writes ``OUT/ttq.json`` (link, tuning, per-variant curves and results; the first run at the top
level, every run under ``runs``, the medians under ``over_runs``) and ``OUT/ttq.png`` (the first
run's perplexity against hours of training clock, the target as a line, each variant's time to
target with the runs' interval as a band; needs matplotlib). The load is sampled before and after
every training launch and a launch taken on a loaded machine is marked (``--strict``: refused).
The rate search records its chosen probe's all-to-all share split into transfer and rank-skew wait
(from the model worker's spans); the training runs' share (rank 0's metrics) is not split.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from typing import Optional, Sequence

from moe_variants import registry
from tools import variants as variant_hooks
from megatron.common.cli import UserError, nonneg_int, positive_int, run_cli, user_input
from megatron.common.files import write_json
from tools.bench.discipline import LoadGate, add_discipline_arguments, format_ci, interval_name, rotations

__all__ = [
    "Curve",
    "load_curve",
    "time_to_target",
    "summarize_curves",
    "summarize_runs",
    "run_dir",
    "launch_records",
    "plot_curves",
    "build_parser",
    "main",
]

PROG = "time_to_quality.py"
SCHEMA = "time_to_quality/1"


@dataclasses.dataclass
class Curve:
    """One variant's run: ``steps`` 1..N with their times, and evaluations ``(step, ppl)``."""

    step_time_s: dict  # step -> seconds (the last record of the step)
    evals: dict  # step -> validation perplexity (the last evaluation at the step)
    done: bool  # the run ended with a summary event that was not an interruption
    a2a_share: Optional[float] = None  # median a2a_time_s / step_time_s over the logged steps

    def points(self) -> list[tuple[int, float, float]]:
        """``(step, training clock in s, ppl)`` per evaluation, in step order. The clock at step s
        is the sum of the times of steps 1..s; a step without a time record is an error (it means
        the run did not log every step)."""
        out, clock, last = [], 0.0, 0
        for step in sorted(self.evals):
            for k in range(last + 1, step + 1):
                if k not in self.step_time_s:
                    raise ValueError(f"no time recorded for step {k} (runs must log every step)")
                clock += self.step_time_s[k]
            last = step
            out.append((step, clock, self.evals[step]))
        return out


def load_curve(metrics_path: str) -> Curve:
    """Read a run's ``metrics.jsonl`` (several appended sessions after resumes; the last record of a
    step wins)."""
    times, evals, done, shares = {}, {}, False, {}
    with open(metrics_path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            event = rec.get("event")
            step = rec.get("step")
            if event is None and "step_time_s" in rec:
                times[int(step)] = float(rec["step_time_s"])
                if rec.get("step_time_s"):
                    shares[int(step)] = float(rec.get("a2a_time_s", 0.0)) / float(rec["step_time_s"])
            elif event == "valid" and "ppl" in rec:
                evals[int(step)] = float(rec["ppl"])
            elif event == "summary":
                done = not rec.get("interrupted", False)
    share = None
    if shares:
        values = sorted(shares.values())
        share = values[len(values) // 2] if len(values) % 2 else 0.5 * (values[len(values) // 2 - 1] + values[len(values) // 2])
    return Curve(step_time_s=times, evals=evals, done=done, a2a_share=share)


def time_to_target(points: Sequence[tuple[int, float, float]], target: float) -> Optional[dict]:
    """When a curve first reaches ``ppl <= target``: ``{"clock_s", "step", "interpolated"}`` or None.

    Between the last evaluation above the target ``(t0, p0)`` and the first at or below it
    ``(t1, p1)`` the clock is interpolated linearly in perplexity:
    ``t0 + (t1 - t0) (p0 - target) / (p0 - p1)``; the step likewise (a fraction). The first
    evaluation at or below the target gives its own clock.
    """
    prev = None
    for step, clock, ppl in points:
        if ppl <= target:
            if prev is None or prev[2] == ppl:
                return {"clock_s": clock, "step": float(step), "interpolated": False}
            s0, t0, p0 = prev
            frac = (p0 - target) / (p0 - ppl)
            return {"clock_s": t0 + frac * (clock - t0), "step": s0 + frac * (step - s0), "interpolated": frac < 1.0}
        prev = (step, clock, ppl)
    return None


def summarize_curves(curves: dict, baseline: str = "standard") -> dict:
    """Per variant: its points, best perplexity, time (and step) to the baseline's best perplexity and
    the speed-up ``baseline time / variant time`` (None where the target is not reached)."""
    if baseline not in curves:
        raise ValueError(f"the baseline {baseline!r} has no curve")
    base_points = curves[baseline].points()
    if not base_points:
        raise ValueError(f"{baseline} has no evaluation yet")
    target = min(p for _, _, p in base_points)
    out = {"baseline": baseline, "target_ppl": target, "variants": {}}
    base = time_to_target(base_points, target)
    for name, curve in curves.items():
        points = curve.points()
        reached = time_to_target(points, target) if points else None
        steps = sorted(curve.step_time_s)
        total = sum(curve.step_time_s[s] for s in steps)
        out["variants"][name] = {
            "done": curve.done,
            "evaluations": [{"step": s, "clock_s": t, "ppl": p} for s, t, p in points],
            "best_ppl": min((p for _, _, p in points), default=None),
            "steps_logged": len(steps),
            "clock_s": total,
            "mean_step_s": total / len(steps) if steps else None,
            "a2a_share_median": curve.a2a_share,
            "to_target": reached,
            "speedup_to_target": (base["clock_s"] / reached["clock_s"]) if reached and reached["clock_s"] > 0 else None,
            "speedup_per_step": None,
        }
    base_step = out["variants"][baseline]["mean_step_s"]
    for name, v in out["variants"].items():
        if base_step and v["mean_step_s"]:
            v["speedup_per_step"] = base_step / v["mean_step_s"]
    return out


RUN_FIGURES = ("speedup_to_target", "to_target_clock_s", "speedup_per_step", "mean_step_s", "a2a_share_median",
               "best_ppl")


def summarize_runs(summaries: Sequence[dict], seed: int = 0) -> dict:
    """``{variant: {figure: median_ci over the runs that have it}}`` of ``RUN_FIGURES`` from each
    run's ``summarize_curves`` (speed-ups are within a run: paired by construction)."""
    from tools.bench.discipline import median_ci

    out = {}
    for name in summaries[0]["variants"] if summaries else []:
        out[name] = {}
        for key in RUN_FIGURES:
            values = []
            for summary in summaries:
                v = summary["variants"].get(name)
                if v is None:
                    continue
                value = (v["to_target"] or {}).get("clock_s") if key == "to_target_clock_s" else v[key]
                if value is not None:
                    values.append(value)
            out[name][key] = median_ci(values, seed=seed) if values else None
    return out


def plot_curves(summary: dict, path: str, title: str = "", over_runs: Optional[dict] = None) -> None:
    """Validation perplexity against the training clock (hours), one line per variant, the target
    dashed; with ``over_runs`` (several runs) each variant's time to target as a band over the runs'
    interval (``interval_name``). matplotlib is imported here (an optional dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("the plot needs matplotlib (pip install -e '.[dev]')") from None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, v in summary["variants"].items():
        ev = v["evaluations"]
        if ev:
            ax.plot([e["clock_s"] / 3600 for e in ev], [e["ppl"] for e in ev], marker="o", ms=3, label=name)
        if v["to_target"]:
            ax.axvline(v["to_target"]["clock_s"] / 3600, color=ax.lines[-1].get_color(), ls=":", lw=0.8)
        ci = ((over_runs or {}).get(name) or {}).get("to_target_clock_s")
        if ci and ci["n"] > 1 and ev:
            ax.axvspan(ci["ci_low"] / 3600, ci["ci_high"] / 3600, color=ax.lines[-1].get_color(), alpha=0.15, lw=0)
    ax.axhline(summary["target_ppl"], color="k", ls="--", lw=0.8,
               label=f"{summary['baseline']}'s best ({summary['target_ppl']:.2f})")  # fmt: skip
    ax.set_xlabel("training clock (h, sum of step times)")
    ax.set_ylabel("validation perplexity")
    ax.set_yscale("log")
    ax.set_title(title or "time to quality on the shaped link")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="run directory (link, per-variant checkpoints and metrics, JSON, PNG)")
    ap.add_argument("--variants", default=None, help="comma-separated bench presets ("
                    + ", ".join(registry.bench_presets()) + "; '+' combines); standard first is the baseline "
                    "(default: " + ",".join(default_variants()) + ")")
    ap.add_argument("--config", metavar="YAML", help="model, data and schedule (e.g. examples/corpus_moe_cpu.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other config override")
    ap.add_argument("--steps", type=positive_int, help="training steps per variant (default: the config's train_iters)")
    ap.add_argument("--eval-interval", type=positive_int, help="evaluate and checkpoint every K steps "
                    "(default: the config's eval_interval)")
    ap.add_argument("--eval-iters", type=positive_int, help="validation batches per evaluation (default: config)")
    ap.add_argument("--ranks", type=positive_int, default=2)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--rotate", type=nonneg_int, default=0, help="train the first run's variants in --variants' "
                    "order rotated left by this many (scripts/ttq_seeds.py rotates between seeds)")
    ap.add_argument("--target-comm-fraction", type=float, metavar="F", default=0.4,
                    help="choose the link rate giving standard this all-to-all share (default 0.4)")
    ap.add_argument("--link-gbit", type=float, default=1.0,
                    help="the rate search's start, or the fixed rate with --fixed-link")
    ap.add_argument("--fixed-link", action="store_true", help="use --link-gbit as it is (no search)")
    ap.add_argument("--no-netns", action="store_true", help="unshaped loopback (smoke runs; no search)")
    ap.add_argument("--probe-steps", type=positive_int, default=3)
    ap.add_argument("--probe-warmup", type=nonneg_int, default=1)
    ap.add_argument("--max-probes", type=positive_int, default=8)
    ap.add_argument("--fraction-tol", type=float, default=0.02)
    ap.add_argument("--timeout-s", type=float, default=48 * 3600.0, help="wall-clock limit of one training launch")
    ap.add_argument("--report-only", action="store_true", help="only rebuild ttq.json/ttq.png from the runs so far")
    add_discipline_arguments(ap, runs_help="run 1 trains in OUT/<variant>, run k in OUT/run<k>/<variant>, same seed")
    return ap


def run_dir(out_dir: str, run: int, variant: str) -> str:
    """Where run ``run`` (from 0) of ``variant`` trains: ``OUT/<variant>`` for the first run (the
    layout of single runs), ``OUT/run<k>/<variant>`` for run k = run + 1 > 1."""
    return os.path.join(out_dir, variant) if run == 0 else os.path.join(out_dir, f"run{run + 1}", variant)


def _schedule(args) -> tuple[int, int, int]:
    """(steps, eval_interval, eval_iters): the flags, else the config's."""
    from megatron.components.arguments import load_yaml
    from tools.bench.cli import set_overrides

    values = load_yaml(args.config) if args.config else {}
    values.update(set_overrides(args.set))
    steps = args.steps or values.get("train_iters")
    interval = args.eval_interval or values.get("eval_interval")
    iters = args.eval_iters or values.get("eval_iters") or 10
    if not steps:
        raise ValueError("--steps is needed (the config sets no train_iters)")
    if not interval:
        raise ValueError("--eval-interval is needed (the config sets no eval_interval)")
    if interval > steps:
        raise ValueError(f"--eval-interval {interval} exceeds --steps {steps}: the curve would have no point")
    return int(steps), int(interval), int(iters)


def default_variants() -> list[str]:
    """``standard`` and the presets of the variants that replace the MoE layer (the question of
    this command is how a cheaper layer's steps trade against its quality)."""
    return ["standard"] + [name for v in registry.variants() if v.moe_layer is not None for name in v.bench_presets]


def _variants(text: Optional[str]) -> list[str]:
    from tools.bench.variant_worker import variant_overrides

    names = [v.strip() for v in text.split(",") if v.strip()] if text is not None else default_variants()
    if not names or names[0] != "standard":
        raise ValueError("--variants must start with standard (the baseline whose best perplexity is the target)")
    if len(set(names)) != len(names):
        raise ValueError(f"--variants lists a variant twice: {text}")
    for v in names:
        from tools.bench import peers

        if peers.get(v) is not None or set(v.split("+")) & set(variant_hooks.runtime_names()):
            raise ValueError(f"--variants {v}: time to quality trains the registered variants' presets only")
        variant_overrides(v)
    return names


def _link(args, net, out_dir, overrides, schedule, log) -> dict:
    """The link of this run: stored in OUT/link.json on first use (with what the runs train), reused
    afterwards; a rerun that would train something else in the same directory is refused."""
    from tools.bench import netns
    from tools.bench.aggregate import uncontended_comm_fraction, variant_stats
    from tools.bench.launcher import launch
    from tools.bench.schema import RankResult, WorkerSpec
    from tools.bench.tune import find_rate

    path = os.path.join(out_dir, "link.json")
    training = {"config": os.path.abspath(args.config) if args.config else None, "overrides": overrides,
                "steps": schedule[0], "eval_interval": schedule[1], "eval_iters": schedule[2], "seed": args.seed}  # fmt: skip
    if os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
        if stored["shaped"] != net.shaped or stored["ranks"] != args.ranks:
            raise UserError(f"{path} was made for {stored['ranks']} ranks, shaped={stored['shaped']}; "
                            "use another --out or the same --ranks/--no-netns")  # fmt: skip
        if stored.get("training") != training:
            changed = sorted(k for k in training if stored.get("training", {}).get(k) != training[k])
            raise UserError(f"{path}: these runs train with other settings ({', '.join(changed)} differ); "
                            "use another --out to change them")  # fmt: skip
        if net.shaped:
            net.set_link(netns.LinkSpec(**stored["link"]))
        gbit = (stored.get("link") or {}).get("gbit")
        log(f"reusing the link of {path}: " + (f"{gbit:.4g} Gbit/s" if gbit else "unshaped loopback"))
        return stored
    record = {"shaped": net.shaped, "ranks": args.ranks, "tuning": None, "link": None, "training": training}
    if net.shaped:
        link = netns.LinkSpec(args.link_gbit, 0.0, netns.Shaper.tbf.value)
        if not args.fixed_link:
            probes = iter(range(10**6))

            def measure(gbit: float) -> float:
                net.set_link(dataclasses.replace(link, gbit=gbit))
                n = next(probes)
                spec = WorkerSpec(variant="standard", output_dir=os.path.join(out_dir, "probes", f"p{n}", "out"),
                                  warmup=args.probe_warmup, steps=args.probe_steps, seed=args.seed,
                                  config_path=os.path.abspath(args.config) if args.config else None,
                                  overrides=overrides, num_threads=args.threads)  # fmt: skip
                raw = launch(net, "tools.bench.variant_worker", spec, os.path.join(out_dir, "probes", f"p{n}"), 3600.0)
                shares[gbit] = variant_stats([RankResult.from_dict(d) for d in raw])
                return uncontended_comm_fraction(shares[gbit])

            shares = {}
            result = find_rate(measure, args.target_comm_fraction, start=args.link_gbit, tol=args.fraction_tol,
                               max_probes=args.max_probes, log=log)  # fmt: skip
            probe = shares.get(result.gbit) or {}
            record["tuning"] = {**result.as_dict(), "probe_variant": "standard", "target": args.target_comm_fraction,
                                "probe_shares": {k: probe[k]["median"] for k in
                                                 ("comm_fraction", "transfer_fraction", "skew_fraction") if k in probe}}
            link = dataclasses.replace(link, gbit=result.gbit)
        net.set_link(link)
        record["link"] = link.as_dict()
    write_json(path, record)
    return record


def _train(args, net, out_dir, variant, overrides, schedule, log, run: int = 0, gate: Optional[LoadGate] = None) -> dict:
    from tools.bench.launcher import launch
    from tools.bench.schema import WorkerSpec

    steps, interval, iters = schedule
    save_dir = run_dir(out_dir, run, variant)
    metrics = os.path.join(save_dir, "metrics.jsonl")
    what = f"{variant}" + (f" (run {run + 1})" if run else "")
    if os.path.exists(metrics) and load_curve(metrics).done and steps in load_curve(metrics).evals:
        log(f"{what}: done earlier ({metrics})")
        return {"skipped": True}
    n = 0
    while os.path.exists(os.path.join(save_dir, "launches", f"l{n}")):
        n += 1
    launch_dir = os.path.join(save_dir, "launches", f"l{n}")
    spec = WorkerSpec(
        variant=variant, output_dir=os.path.join(launch_dir, "out"), warmup=0, steps=1, seed=args.seed,
        config_path=os.path.abspath(args.config) if args.config else None, overrides=overrides,
        options={"save_dir": save_dir, "steps": steps, "eval_interval": interval, "eval_iters": iters},
        num_threads=args.threads,
    )  # fmt: skip
    gate = gate or LoadGate(args.load_threshold, expected=args.ranks * args.threads, strict=args.strict)
    before = gate.before(f"{what} launch {n}")
    started = time.time()
    t0 = time.monotonic()
    launch(net, "tools.bench.ttq_worker", spec, launch_dir, args.timeout_s)
    took = time.monotonic() - t0
    mark = gate.after(before, f"{what} launch {n}")
    log(f"{what}: launch {n} finished in {took:.0f}s" + (f"  LOADED: {'; '.join(mark['reasons'])}" if mark["loaded"] else ""))
    record = {"variant": variant, "run": run, "launch": n, "started": started, "wall_s": took,
              "loadavg_start": before["loadavg_1_5_15"],
              "loadavg_end": mark["after"]["loadavg_1_5_15"], "load": mark}
    write_json(os.path.join(launch_dir, "record.json"), record)  # kept for every later report
    return record


def launch_records(out_dir: str, variants: Sequence[str], runs: int) -> list:
    """Every training launch's record (``launches/l<n>/record.json``: wall time and load marks) of
    ``variants`` x ``runs`` in ``out_dir``, in the order they started: a later invocation that only
    resumes or reports keeps the earlier launches' load marks."""
    found = []
    for r in range(runs):
        for v in variants:
            root = os.path.join(run_dir(out_dir, r, v), "launches")
            names = os.listdir(root) if os.path.isdir(root) else []
            for n in sorted(int(d[1:]) for d in names if d.startswith("l") and d[1:].isdigit()):
                path = os.path.join(root, f"l{n}", "record.json")
                if os.path.exists(path):
                    with open(path) as f:
                        found.append(json.load(f))
    return sorted(found, key=lambda rec: rec.get("started", 0.0))


def _report(args, out_dir, variants, record, launches) -> dict:
    summaries = []
    for r in range(args.runs):
        curves = {}
        for v in variants:
            path = os.path.join(run_dir(out_dir, r, v), "metrics.jsonl")
            if os.path.exists(path):
                curves[v] = load_curve(path)
        if "standard" in curves and curves["standard"].evals:
            summaries.append({"run": r, **summarize_curves(curves, "standard")})
        elif r == 0:
            raise UserError(f"no standard run in {out_dir} yet")
    over = summarize_runs(summaries, seed=args.seed)
    summary = {k: v for k, v in summaries[0].items() if k != "run"}
    on_disk = launch_records(out_dir, variants, args.runs)
    keys = {(la["variant"], la["run"], la["launch"]) for la in on_disk}
    launches = on_disk + [la for la in launches if not la.get("skipped")
                          and (la["variant"], la["run"], la.get("launch")) not in keys]
    loaded = sorted({(la["variant"], la["run"]) for la in launches if (la.get("load") or {}).get("loaded")})
    result = {
        "schema": SCHEMA,
        "command": ["python", "scripts/time_to_quality.py", *sys.argv[1:]],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "link": record,
        "launches": launches,
        "runs_requested": args.runs,
        "load_rule": LoadGate(args.load_threshold, expected=args.ranks * args.threads).rule,
        "loaded_launches": [{"variant": v, "run": r} for v, r in loaded],
        **summary,
        "runs": summaries,
        "over_runs": over,
    }
    write_json(os.path.join(out_dir, "ttq.json"), result)
    gbit = (record or {}).get("link", {}) or {}
    plot_curves(summary, os.path.join(out_dir, "ttq.png"),
                title=f"{', '.join(variants)} on a {gbit.get('gbit', 'unshaped'):.3g} Gbit/s link" if gbit
                else "time to quality (unshaped loopback)", over_runs=over if len(summaries) > 1 else None)  # fmt: skip
    return result


def _print(result) -> None:
    runs = len(result.get("runs") or [None])
    print(f"target: {result['baseline']}'s best validation perplexity {result['target_ppl']:.3f}"
          + (f" (first run; {runs} runs summarized)" if runs > 1 else ""))
    over = result.get("over_runs") or {}
    print(f"{'variant':<16} {'best ppl':>9} {'step ms':>22} {'a2a %':>18} {'to target s':>24} {'at step':>8} "
          f"{'speedup':>22} {'per step':>8}")  # fmt: skip
    for name, v in result["variants"].items():
        t = v["to_target"]
        o = over.get(name) or {}
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731

        def ci(key, single, scale=1.0, f="{:.1f}"):
            return format_ci(o[key], scale, f) if runs > 1 and o.get(key) else single

        print(f"{name:<16} {fmt(v['best_ppl'], '9.3f')} "
              f"{ci('mean_step_s', fmt(v['mean_step_s'] and v['mean_step_s'] * 1e3, '.1f'), 1e3):>22} "
              f"{ci('a2a_share_median', fmt(v['a2a_share_median'] and v['a2a_share_median'] * 100, '.1f'), 100):>18} "
              f"{ci('to_target_clock_s', fmt(t and t['clock_s'], '.1f')):>24} {fmt(t and t['step'], '8.1f')} "
              f"{ci('speedup_to_target', fmt(v['speedup_to_target'], '.3f'), 1.0, '{:.3f}'):>22} "
              f"{fmt(v['speedup_per_step'], '8.3f')}"
              + ("" if v["done"] else "  (running)"))  # fmt: skip
    if runs > 1:
        print(f"step ms, a2a %, to target s, speedup: medians over {runs} runs [{interval_name(runs)}]; "
              "the rest: the first run")
    for item in result.get("loaded_launches") or []:
        print(f"* {item['variant']} run {item['run'] + 1}: a launch was taken on a loaded machine (see launches)")
    tuning = (result.get("link") or {}).get("tuning")
    if tuning:
        shares = tuning.get("probe_shares") or {}
        line = (f"all-to-all share of standard: target {tuning.get('target', float('nan')):.3f}, rate search "
                f"{tuning['fraction']:.3f} (a2a / (a2a + fastest compute))")
        if "transfer_fraction" in shares:
            line += (f", its probe {shares['comm_fraction']:.3f} = transfer {shares['transfer_fraction']:.3f} + skew "
                     f"{shares['skew_fraction']:.3f}")
        std = over.get("standard", {}).get("a2a_share_median")
        if std:
            line += f"; training runs {format_ci(std, fmt='{:.3f}')} (in flight, rank 0)"
        print(line)


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)

    def body():
        from tools.bench import netns

        with user_input():
            variants = _variants(args.variants)
        if args.config and not os.path.isfile(args.config):
            raise UserError(f"--config {args.config}: no such file")
        out_dir = os.path.abspath(args.out)
        os.makedirs(out_dir, exist_ok=True)
        if args.report_only:
            link_path = os.path.join(out_dir, "link.json")
            record = json.load(open(link_path)) if os.path.exists(link_path) else None
            _print(_report(args, out_dir, variants, record, []))
            return 0
        from tools.bench.cli import set_overrides

        with user_input():
            schedule = _schedule(args)
            overrides = set_overrides(args.set)
        if not args.no_netns and os.geteuid() == 0:
            netns.cleanup_stale()
        link = netns.LinkSpec(args.link_gbit, 0.0, netns.Shaper.tbf.value)
        launches = []
        with netns.terminate_on_signals(), netns.open_network(args.ranks, link, use_netns=not args.no_netns) as net:
            if not net.shaped and not args.no_netns:
                raise UserError("network namespaces are unavailable (root and iproute2 needed); "
                                "--no-netns runs unshaped smoke tests only")  # fmt: skip
            record = _link(args, net, out_dir, overrides, schedule, print)
            gate = LoadGate(args.load_threshold, expected=args.ranks * args.threads, strict=args.strict)
            for r, order in enumerate(rotations(variants, args.runs, start=args.rotate)):
                for v in order:
                    launches.append({"variant": v, "run": r,
                                     **_train(args, net, out_dir, v, overrides, schedule, print, run=r, gate=gate)})
        result = _report(args, out_dir, variants, record, launches)
        _print(result)
        print(f"wrote {os.path.join(out_dir, 'ttq.json')} and ttq.png")
        return 0

    from tools.bench.launcher import LaunchError

    return run_cli(PROG, body, user_errors=(UserError, LaunchError))


if __name__ == "__main__":
    sys.exit(main())
