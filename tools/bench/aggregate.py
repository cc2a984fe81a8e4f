"""Per-variant statistics, ratios against the baseline, and the printed table (pure functions).

Statistics pool every (rank, measured step) pair of a variant: a metric's ``median``/``min``/
``max`` are over ranks x steps. Ranks run in lock-step (every all-to-all synchronises them), so
pooling adds rank spread to the min/max without moving the median much. Derived per-(rank, step)
quantities:

* ``comm_fraction``     ``a2a_time_s / step_time_s``: share of the step an all-to-all was in flight.
* ``exposed_fraction``  ``exposed_comm_s / step_time_s``: share the compute thread was blocked.
* ``compute_s``         ``step_time_s - exposed_comm_s``: the step's time not spent blocked on an
                        all-to-all.
* ``a2a_bytes``         ``a2a_bytes_dispatch + a2a_bytes_combine`` (forward, off-rank).
* ``overlap_fwd/bwd``   ``1 - exposed / in-flight`` all-to-all time per direction (model workers),
                        with ``pooled`` = 1 - sum(exposed) / sum(in-flight) over all ranks and steps.
* ``overlap_bound_fwd/bwd``  ``min(1, W / in-flight)``: W is the compute the schedule placed in the
                        collectives' windows (launch to wait; ``tools/bench/overlap.py``), the most
                        that schedule can hide (paper Eq. 9); ``pooled`` over ranks and steps.
* ``overlap_to_bound_fwd/bwd``  pooled overlap / pooled bound: how much of what the schedule offers
                        the implementation hides.

``tokens_per_s`` is the global rate per step: the sum of every rank's tokens divided by the
slowest rank's step time; its stats are over steps. Ratios compare medians:
``step_time_speedup = baseline step / variant step`` (> 1: faster than the baseline),
``bytes_ratio = variant a2a_bytes / baseline a2a_bytes``, ``a2a_time_ratio`` likewise.
Workers report the (token, expert) pairs routed and kept by the capacity per step (``extra``:
``routed_rows``, ``kept_rows``; our layers through ``moe_variants.common.routing.DropCounter``), and a
worker that pads its dispatch buffers to a capacity (the ``deepspeed-moe`` peer) the rows it sends
(``buffer_rows``); they become ``dispatch_rows`` (``routed``, ``kept``, ``dropped_fraction`` = 1 -
kept / routed, ``buffer``, ``padding_factor`` = buffer / routed, over all ranks and steps) and a line
under the table where something was dropped or padded.

Workers that record each step's collectives (``extra["a2a_spans"]``: ours, not the upstream peers)
get the in-flight time split into ``transfer_s`` and ``skew_s`` (rank-skew wait), per (rank, step)
(``tools.bench.overlap.transfer_skew``), with ``transfer_fraction`` and ``skew_fraction`` of the step:
``comm_fraction = transfer_fraction + skew_fraction``.

Several runs (``--runs``): ``merge_runs`` pools a variant's runs as more steps (``variant_stats`` of
the merge is over runs x ranks x steps); ``over_runs_stats`` takes each run's median of the
``RUN_FIGURES`` and gives their median with an interval (the range of the runs, or at 5 runs or
more a 95% bootstrap interval: ``tools.bench.discipline.median_ci``), and the step-time speedup
paired by run (the baseline's run-r median over the variant's run-r median: they ran side by side).
"""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

from .discipline import format_ci, interval_name, median_ci, paired_ratios
from .overlap import transfer_skew_steps
from .schema import RankResult

__all__ = ["summarize", "variant_stats", "uncontended_comm_fraction", "ratios_vs", "format_table", "format_rows",
           "TABLE_COLUMNS", "merge_runs", "over_runs_stats", "RUN_FIGURES"]

_TIME_FIELDS = ("step_time_s", "fwd_time_s", "bwd_time_s", "a2a_time_s", "exposed_comm_s")
_COUNT_FIELDS = ("a2a_bytes_dispatch", "a2a_bytes_combine", "tokens")


def summarize(values: Sequence[float]) -> dict:
    """``{"median", "min", "max", "n"}`` of a non-empty sequence."""
    values = list(values)
    if not values:
        raise ValueError("no values to summarize")
    return {
        "median": float(statistics.median(values)),
        "min": float(min(values)),
        "max": float(max(values)),
        "n": len(values),
    }


def _pooled(results: Sequence[RankResult], field: str) -> list[float]:
    return [float(v) for r in results for v in getattr(r, field)]


def variant_stats(results: Sequence[RankResult]) -> dict:
    """Statistics of one variant's launch from its per-rank results (see the module docstring)."""
    if not results:
        raise ValueError("no rank results")
    num_steps = len(results[0].step_time_s)
    for r in results:
        r.validate(num_steps)
    ranks = sorted(r.rank for r in results)
    if ranks != list(range(results[0].world_size)):
        raise ValueError(f"rank results {ranks} do not cover world size {results[0].world_size}")
    out: dict = {"num_ranks": len(results), "num_steps": num_steps}
    for field in _TIME_FIELDS + _COUNT_FIELDS:
        out[field] = summarize(_pooled(results, field))
    out["a2a_bytes"] = summarize(
        [float(d + c) for r in results for d, c in zip(r.a2a_bytes_dispatch, r.a2a_bytes_combine)]
    )
    if all(r.a2a_bytes_backward is not None for r in results):
        out["a2a_bytes_backward"] = summarize(_pooled(results, "a2a_bytes_backward"))
    out["comm_fraction"] = summarize(
        [a / s for r in results for a, s in zip(r.a2a_time_s, r.step_time_s) if s > 0]
    )
    out["compute_s"] = summarize(
        [s - e for r in results for s, e in zip(r.step_time_s, r.exposed_comm_s)]
    )
    out["exposed_fraction"] = summarize(
        [e / s for r in results for e, s in zip(r.exposed_comm_s, r.step_time_s) if s > 0]
    )
    per_step_rate = []
    for i in range(num_steps):
        slowest = max(r.step_time_s[i] for r in results)
        if slowest > 0:
            per_step_rate.append(sum(r.tokens[i] for r in results) / slowest)
    out["tokens_per_s"] = summarize(per_step_rate)
    # Overlap of all-to-all time with compute, per direction (model workers report the split):
    # 1 - exposed / in-flight, per (rank, step). Blocking collectives give 0.
    for direction in ("fwd", "bwd"):
        pairs = [
            (e, t) for r in results
            for e, t in zip(r.extra.get(f"exposed_{direction}_s", []), r.extra.get(f"a2a_time_{direction}_s", []))
        ]  # fmt: skip
        if pairs and any(t > 0 for _, t in pairs):
            out[f"overlap_{direction}"] = summarize([1.0 - e / t for e, t in pairs if t > 0])
            total_e, total_t = sum(e for e, _ in pairs), sum(t for _, t in pairs)
            out[f"overlap_{direction}"]["pooled"] = 1.0 - total_e / total_t
            windows = [(w, t) for r in results for w, t in zip(r.extra.get(f"window_compute_{direction}_s", []),
                                                                 r.extra.get(f"a2a_time_{direction}_s", []))]
            if windows:
                out[f"overlap_bound_{direction}"] = summarize([min(1.0, w / t) for w, t in windows if t > 0])
                bound = min(1.0, sum(w for w, _ in windows) / total_t)
                out[f"overlap_bound_{direction}"]["pooled"] = bound
                out[f"overlap_to_bound_{direction}"] = (1.0 - total_e / total_t) / bound if bound > 0 else None
    split = _split(results, num_steps)
    if split is not None:
        transfer = [t for r in split for t in r["transfer_s"]]
        skew = [k for r in split for k in r["skew_s"]]
        steps = [s for r in results for s in r.step_time_s]
        out["transfer_s"] = summarize(transfer)
        out["skew_s"] = summarize(skew)
        out["transfer_fraction"] = summarize([t / s for t, s in zip(transfer, steps) if s > 0])
        out["skew_fraction"] = summarize([k / s for k, s in zip(skew, steps) if s > 0])
    out["peak_rss_mb"] = summarize([r.peak_rss_mb for r in results])
    # capacity dropping and padded dispatch: (token, expert) rows routed, kept and sent
    if all("routed_rows" in r.extra for r in results):
        routed = sum(sum(r.extra["routed_rows"]) for r in results)
        rows = {"routed": routed}
        if all("kept_rows" in r.extra for r in results):
            rows["kept"] = sum(sum(r.extra["kept_rows"]) for r in results)
            rows["dropped_fraction"] = 1.0 - rows["kept"] / routed if routed else None
        if all("buffer_rows" in r.extra for r in results):
            rows["buffer"] = sum(sum(r.extra["buffer_rows"]) for r in results)
            rows["padding_factor"] = rows["buffer"] / routed if routed else None
        out["dispatch_rows"] = rows
    return out


def _split(results: Sequence[RankResult], num_steps: int) -> Optional[list]:
    """Per rank ``{"transfer_s": [...], "skew_s": [...]}`` from the recorded spans, or None."""
    spans = [r.extra.get("a2a_spans") for r in sorted(results, key=lambda r: r.rank)]
    if any(not isinstance(x, list) or len(x) != num_steps for x in spans):
        return None
    if not any(step for x in spans for step in x):  # no collective recorded (one rank, upstream layers)
        return None
    return transfer_skew_steps(spans)


def merge_runs(runs: Sequence[Sequence[RankResult]]) -> list[RankResult]:
    """One result per rank holding every run's steps in run order (per-step lists of ``extra``
    concatenated; other ``extra`` entries from the first run; the peak RSS the largest)."""
    if not runs:
        raise ValueError("no runs")
    by_rank = [sorted(run, key=lambda r: r.rank) for run in runs]
    if any([r.rank for r in run] != [r.rank for r in by_rank[0]] for run in by_rank):
        raise ValueError("the runs have different ranks")
    merged = []
    for i, first in enumerate(by_rank[0]):
        mine = [run[i] for run in by_rank]
        fields = {f: [v for r in mine for v in getattr(r, f)] for f in ("step_time_s", "fwd_time_s", "bwd_time_s",
                  "a2a_time_s", "exposed_comm_s", "a2a_bytes_dispatch", "a2a_bytes_combine", "tokens")}
        backward = None
        if all(r.a2a_bytes_backward is not None for r in mine):
            backward = [v for r in mine for v in r.a2a_bytes_backward]
        extra = dict(first.extra)
        for key, value in first.extra.items():
            if isinstance(value, list) and all(isinstance(r.extra.get(key), list)
                                               and len(r.extra[key]) == len(r.step_time_s) for r in mine):
                extra[key] = [v for r in mine for v in r.extra[key]]
        merged.append(RankResult(rank=first.rank, world_size=first.world_size, variant=first.variant,
                                 peak_rss_mb=max(r.peak_rss_mb for r in mine), a2a_bytes_backward=backward,
                                 extra=extra, **fields))
    return merged


# each run's median of these is a run's figure (``over_runs_stats``)
RUN_FIGURES = ("step_time_s", "tokens_per_s", "a2a_time_s", "exposed_comm_s", "comm_fraction", "transfer_fraction",
               "skew_fraction")


def over_runs_stats(per_run: Sequence[dict], baseline: str, seed: int = 0) -> dict:
    """``{variant: {figure: median_ci over runs, ..., "step_time_speedup": median_ci}}`` from
    ``per_run[r] = {variant: variant_stats of run r}`` (a figure a run lacks is left out; None when
    no run has it)."""
    if not per_run:
        raise ValueError("no runs")
    out = {}
    for name in per_run[0]:
        figures = {}
        for key in RUN_FIGURES:
            values = [run[name][key]["median"] for run in per_run if key in run[name]]
            figures[key] = median_ci(values, seed=seed) if values else None
        speedups = paired_ratios([run[baseline]["step_time_s"]["median"] for run in per_run],
                                 [run[name]["step_time_s"]["median"] for run in per_run])
        figures["step_time_speedup"] = median_ci(speedups, seed=seed) if speedups else None
        out[name] = figures
    return out


def uncontended_comm_fraction(stats: dict) -> float:
    """All-to-all share of a step run at the fastest compute seen: ``A / (A + C_min)``.

    ``A`` is the median in-flight all-to-all time, ``C_min`` the minimum compute time over ranks
    and steps. On a shared host the compute speed drifts by 10-20% from minute to minute while
    the all-to-all time at a given link rate does not (it is set by the shaper), so a link rate
    chosen from the median share inherits the drift and amplifies it into the step time; the
    minimum compute time estimates the uncontended speed and is far more repeatable.
    """
    a2a = stats["a2a_time_s"]["median"]
    compute = stats["compute_s"]["min"]
    if a2a + compute <= 0:
        raise ValueError("no time measured")
    return a2a / (a2a + max(compute, 0.0))


def _ratio(num: float, den: float) -> Optional[float]:
    return None if den == 0 else num / den


def ratios_vs(stats: dict, baseline: str) -> dict:
    """``{variant: {step_time_speedup, bytes_ratio, a2a_time_ratio, comm_fraction}}`` vs ``baseline``."""
    if baseline not in stats:
        raise ValueError(f"baseline variant {baseline!r} was not measured")
    base = stats[baseline]
    out = {}
    for name, s in stats.items():
        out[name] = {
            "step_time_speedup": _ratio(base["step_time_s"]["median"], s["step_time_s"]["median"]),
            "bytes_ratio": _ratio(s["a2a_bytes"]["median"], base["a2a_bytes"]["median"]),
            "a2a_time_ratio": _ratio(s["a2a_time_s"]["median"], base["a2a_time_s"]["median"]),
            "comm_fraction": s["comm_fraction"]["median"],
        }
    return out


TABLE_COLUMNS = (
    "variant", "step ms", "fwd ms", "bwd ms", "a2a ms", "exposed ms", "comm %", "xfer %", "skew %", "ovl fwd %",
    "ovl bwd %", "bound fwd %", "bound bwd %", "a2a MiB/step", "tok/s", "RSS MiB", "speedup", "bytes x",
)  # fmt: skip


def _fmt_ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def format_table(stats: dict, ratios: Optional[dict] = None, over_runs: Optional[dict] = None,
                 loaded: Optional[dict] = None) -> str:
    """A fixed-width table, one row per variant: medians, the step time with [min-max] over ranks x
    steps; with ``over_runs`` (several runs) the step time, the all-to-all shares and the speedup are
    medians over the runs with [their interval] (named under the table). ``loaded`` (variant -> indices
    of loaded runs, from 0) marks a variant with ``*`` and lists its loaded runs (from 1) under it."""
    rows = [TABLE_COLUMNS]

    def pct(s, key):
        return f"{s[key]['median'] * 100:.1f}" if key in s else "-"

    for name, s in stats.items():
        st = s["step_time_s"]
        r = (ratios or {}).get(name, {})
        o = (over_runs or {}).get(name)
        rows.append((
            name + ("*" if (loaded or {}).get(name) else ""),
            format_ci(o["step_time_s"], 1e3) if o else f"{st['median'] * 1e3:.1f} [{st['min'] * 1e3:.1f}-{st['max'] * 1e3:.1f}]",
            f"{s['fwd_time_s']['median'] * 1e3:.1f}",
            f"{s['bwd_time_s']['median'] * 1e3:.1f}",
            f"{s['a2a_time_s']['median'] * 1e3:.1f}",
            f"{s['exposed_comm_s']['median'] * 1e3:.1f}",
            format_ci(o["comm_fraction"], 100) if o else pct(s, "comm_fraction"),
            format_ci(o["transfer_fraction"], 100) if o and o["transfer_fraction"] else pct(s, "transfer_fraction"),
            format_ci(o["skew_fraction"], 100) if o and o["skew_fraction"] else pct(s, "skew_fraction"),
            f"{s['overlap_fwd']['pooled'] * 100:.1f}" if "overlap_fwd" in s else "-",
            f"{s['overlap_bwd']['pooled'] * 100:.1f}" if "overlap_bwd" in s else "-",
            f"{s['overlap_bound_fwd']['pooled'] * 100:.1f}" if "overlap_bound_fwd" in s else "-",
            f"{s['overlap_bound_bwd']['pooled'] * 100:.1f}" if "overlap_bound_bwd" in s else "-",
            f"{s['a2a_bytes']['median'] / 2**20:.3f}",
            f"{s['tokens_per_s']['median']:.0f}",
            f"{s['peak_rss_mb']['max']:.0f}",
            format_ci(o["step_time_speedup"], fmt="{:.3f}") if o else _fmt_ratio(r.get("step_time_speedup")),
            _fmt_ratio(r.get("bytes_ratio")),
        ))  # fmt: skip
    lines = [format_rows(rows[0], rows[1:])]
    if over_runs:
        n = max((o["step_time_s"]["n"] for o in over_runs.values() if o.get("step_time_s")), default=1)
        lines.append(f"step ms, comm/xfer/skew %, speedup: medians over {n} runs [{interval_name(n)}]; "
                     "the rest pooled over runs x ranks x steps")
    for name, runs in (loaded or {}).items():
        if runs:
            lines.append(f"* {name}: run(s) {', '.join(str(r + 1) for r in runs)} taken on a loaded machine "
                         "(the JSON's runs[].load says why)")
    for name, s in stats.items():
        rows = s.get("dispatch_rows") or {}
        if rows.get("dropped_fraction"):
            lines.append(f"{name}: capacity dropped {rows['routed'] - rows['kept']} of {rows['routed']} routed "
                         f"(token, expert) pairs ({rows['dropped_fraction'] * 100:.2f}%)")
        if rows.get("padding_factor") is not None:
            lines.append(f"{name}: dispatch buffers padded to capacity: {rows['buffer']} rows sent for "
                         f"{rows['routed']} routed (x{rows['padding_factor']:.3f})")
    return "\n".join(lines)


def format_rows(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """A fixed-width table of strings: the first ``left`` columns left-aligned, the rest right-aligned,
    a rule under the header."""
    rows = [tuple(header), *[tuple(r) for r in rows]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
