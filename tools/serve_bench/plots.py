"""PNG plots of a serving benchmark result (matplotlib, imported lazily through ``netsim.plots``).

Serving mode:

* ``<stem>_latency.png``     TTFT, TPOT and end-to-end latency (p50 solid, p99 dashed, pooled over
                             the runs) vs request rate, one colour per variant; with several runs
                             the bars are the interval of the runs' percentiles;
* ``<stem>_throughput.png``  output tokens/s (bars: the runs' interval) and goodput (requests/s
                             within the SLOs) vs rate.

The interval is the range of the runs, or at 5 runs or more their 95% bootstrap interval
(``tools.bench.discipline.interval_name`` labels it).

Prefill mode: ``<stem>_prefill.png``, prefill tokens/s per variant (median over the runs with their
interval as bars; one run: over its bursts, min-max bars) with the baseline's Amdahl
bound (its transfer share removed, or its in-flight share without the split) as a line.
"""

from __future__ import annotations

import os

from netsim.plots import pyplot, save_png
from tools.bench.discipline import interval_name

__all__ = ["write_plots"]


def _rates(stats: dict) -> list:
    return sorted(stats["rates"], key=float)


def _rate_axis(ax, rates: list) -> list:
    """Rates as evenly spaced categories (an ``inf`` rate, all requests at once, included)."""
    ax.set_xticks(range(len(rates)))
    ax.set_xticklabels(rates)
    ax.set_xlabel("request rate (req/s)")
    return list(range(len(rates)))


def _serve(plt, result: dict, out_dir: str, stem: str) -> list:
    variants = result["variants"]
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (key, title, scale, unit) in zip(axes, [("ttft_s", "time to first token", 1e3, "ms"),
                                                    ("tpot_s", "time per output token", 1e3, "ms"),
                                                    ("e2e_s", "end-to-end latency", 1.0, "s")]):
        for i, (name, s) in enumerate(variants.items()):
            rates = _rates(s)
            x = _rate_axis(ax, rates)
            color = f"C{i}"
            for q, style in (("p50", "-"), ("p99", "--")):
                y = [s["rates"][r][key][q] for r in rates]
                y = [v * scale if v is not None else float("nan") for v in y]
                ax.plot(x, y, style, marker="o", ms=4, color=color, label=f"{name} {q}")
                cis = [(s["rates"][r].get("over_runs") or {}).get(f"{key}.{q}") for r in rates]
                _ci_lines(ax, x, cis, scale, color)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(_title(result))
    written.append(save_png(fig, os.path.join(out_dir, f"{stem}_latency.png")))
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for i, (name, s) in enumerate(variants.items()):
        rates = _rates(s)
        x = _rate_axis(axes[0], rates)
        _rate_axis(axes[1], rates)
        y = [s["rates"][r]["output_tokens_per_s"] for r in rates]
        axes[0].plot(x, y, marker="o", color=f"C{i}", label=name)
        cis = [(s["rates"][r].get("over_runs") or {}).get("output_tokens_per_s") for r in rates]
        _ci_lines(axes[0], x, cis, 1.0, f"C{i}")
        axes[1].plot(x, [s["rates"][r]["requests_per_s"] for r in rates], ":", marker="s", color=f"C{i}",
                     label=f"{name} completed")
        axes[1].plot(x, [s["rates"][r]["goodput_requests_per_s"] for r in rates], marker="o", color=f"C{i}",
                     label=f"{name} goodput")
    axes[0].set_title("output tokens/s")
    axes[1].set_title("requests/s (goodput: within the SLOs)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_title(result))
    written.append(save_png(fig, os.path.join(out_dir, f"{stem}_throughput.png")))
    plt.close(fig)
    return written


def _prefill(plt, result: dict, out_dir: str, stem: str) -> list:
    variants = result["variants"]
    names = list(variants)
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 3.8))
    over = [(variants[n].get("over_runs") or {}).get("prefill_tokens_per_s") for n in names]
    several = any(c and c["n"] > 1 for c in over)
    if several:  # medians over the runs, bars their interval
        values = [c["median"] if c else 0.0 for c in over]
        errors = _ci_bars(values, over)
    else:
        stats = [variants[n]["prefill_tokens_per_s"] for n in names]
        values = [s["median"] if s else 0.0 for s in stats]
        errors = [[v - (s["min"] if s else v) for v, s in zip(values, stats)],
                  [(s["max"] if s else v) - v for v, s in zip(values, stats)]]
    ax.bar(names, values, yerr=errors, capsize=4, color=[f"C{i}" for i in range(len(names))])
    r0 = result["ratios"][names[0]]
    bound = r0.get("amdahl_bound")
    if bound is not None and values[0]:
        basis = r0.get("amdahl_basis", "in flight")
        share = r0["baseline_transfer_fraction"] if basis == "transfer" else r0["baseline_a2a_fraction"]
        ax.axhline(values[0] * bound, ls="--", color="k", lw=1,
                   label=f"Amdahl bound {bound:.2f}x ({names[0]}'s all-to-all {basis} share {share:.2f} removed)")
        ax.legend(fontsize=7)
    for i, n in enumerate(names):
        speedup = result["ratios"][n]["throughput_speedup"]
        if speedup is not None:
            ax.text(i, values[i] + errors[1][i], f"{speedup:.2f}x", ha="center", va="bottom", fontsize=8)
    runs = max((c["n"] for c in over if c), default=1)
    ax.set_ylabel(f"prefill tokens/s (median, {interval_name(runs)})" if several else
                  "prefill tokens/s (median, min-max)")
    ax.set_title(_title(result))
    path = save_png(fig, os.path.join(out_dir, f"{stem}_prefill.png"))
    plt.close(fig)
    return [path]


def _ci_bars(values: list, cis: list) -> list:
    """Error bars ``[below, above]`` of ``median_ci`` dicts around their medians ``values``."""
    return [[v - c["ci_low"] if c else 0.0 for v, c in zip(values, cis)],
            [c["ci_high"] - v if c else 0.0 for v, c in zip(values, cis)]]


def _ci_lines(ax, x: list, cis: list, scale: float, color: str) -> None:
    """The runs' intervals (``median_ci`` dicts, several runs only) as vertical lines at ``x``."""
    marks = [(xi, c["ci_low"] * scale, c["ci_high"] * scale) for xi, c in zip(x, cis) if c and c["n"] > 1]
    if marks:
        ax.vlines([m[0] for m in marks], [m[1] for m in marks], [m[2] for m in marks], colors=color, lw=2, alpha=0.4)


def _title(result: dict) -> str:
    net = result["network"]
    link = f"{net['link']['gbit']:.3g} Gbit/s per rank" if net.get("shaped") else "unshaped loopback"
    return f"{result['config']['ranks']} ranks (EP), {link}"


def write_plots(result: dict, out_dir: str, stem: str) -> list:
    """Write the mode's plots into ``out_dir`` as ``<stem>_*.png``; returns their paths."""
    plt = pyplot()
    os.makedirs(out_dir, exist_ok=True)
    if result["mode"] == "prefill":
        return _prefill(plt, result, out_dir, stem)
    return _serve(plt, result, out_dir, stem)
