"""PNG plots of a sweep result (matplotlib, imported lazily; ``pip install matplotlib`` if missing).

* ``bandwidth_scaleup.png``   scale-up throughput/cost vs link bandwidth, per scenario (Fig. 12)
* ``bandwidth_topologies.png``every topology's throughput/cost vs bandwidth, DBO+SD
* ``topologies_1x.png``       the four topologies at the 1x provision, relative to scale-up (Fig. 14/15)
* ``pareto.png``              performance-cost plane with the Pareto frontier (Fig. 17)
* ``variants.png``            BigMac / Sem-MoE / FarSkip / combined gains per topology
* ``generations.png``         throughput vs bandwidth on H100 / Blackwell / Rubin (Fig. 18)
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_plots", "pyplot", "save_png"]

_COLORS = {"scale-up": "tab:blue", "scale-out": "tab:gray", "torus3d": "tab:orange", "fullmesh3d": "tab:green"}
_MARKERS = {"scale-up": "o", "scale-out": "s", "torus3d": "^", "fullmesh3d": "D"}


def pyplot():
    """matplotlib's pyplot on the Agg backend, or a one-line ValueError with the install hint."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plots need matplotlib: pip install matplotlib (or pass --no-plots)") from None
    return plt


def _grid(plt, result, title):
    cfg = result["config"]
    rows, cols = len(cfg["contexts"]), len(cfg["tpots_ms"])
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    fig.suptitle(title)
    return fig, axes, cfg


def _log_ticks(ax, values):
    """Log x axis labelled at the swept values only (matplotlib's minor labels overlap)."""
    from matplotlib.ticker import NullFormatter, NullLocator

    vals = sorted(set(float(v) for v in values))
    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(vals)
    ax.set_xticklabels([f"{v:g}" for v in vals], fontsize=6, rotation=45)


def _key(t, c):
    return f"tpot{t:g}ms_ctx{c}"


def save_png(fig, path: Path) -> Path:
    """Lay out ``fig`` and write it to ``path`` through a temporary file renamed into place."""
    path = Path(path)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
    return path


def write_plots(result: dict, out_dir) -> list[Path]:
    """Write every plot the result has data for into ``out_dir``; returns the paths."""
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    a = result["analyses"]
    recs = result["records"]
    n_ref = result["config"]["reference_size"]

    if a.get("bandwidth"):
        fig, axes, cfg = _grid(plt, result, f"Scale-up, {n_ref} XPUs: throughput per cost vs link bandwidth")
        for i, c in enumerate(cfg["contexts"]):
            for j, t in enumerate(cfg["tpots_ms"]):
                ax = axes[i][j]
                for opt, e in a["bandwidth"][_key(t, c)].items():
                    ax.plot(e["bandwidths_gbps"], e["throughput_per_cost"], marker="o", ms=3, label=opt)
                    if "sweet_spot_gbps" in e:
                        k = e["bandwidths_gbps"].index(e["sweet_spot_gbps"])
                        ax.plot([e["sweet_spot_gbps"]], [e["throughput_per_cost"][k]], "k*", ms=9)
                ax.axvline(450 * cfg.get("link_bandwidth_scale", 1.0), color="k", lw=0.5, ls=":")
                ax.set_title(f"TPOT {t:g} ms, context {c}", fontsize=9)
                ax.set_xlabel("link bandwidth per XPU (GB/s)")
                ax.set_ylabel("tokens/s per XPU / norm. cost")
                ax.legend(fontsize=7)
        written.append(save_png(fig, out / "bandwidth_scaleup.png"))
        plt.close(fig)

    opt_last = result["config"]["optimizations"][-1]
    fig, axes, cfg = _grid(plt, result, f"Throughput per cost vs bandwidth, {n_ref} XPUs, {opt_last}")
    for i, c in enumerate(cfg["contexts"]):
        for j, t in enumerate(cfg["tpots_ms"]):
            ax = axes[i][j]
            for topo in cfg["topologies"]:
                rs = sorted((r for r in recs if r["variant"] == "baseline" and r["topology"] == topo and r["num_xpus"] == n_ref
                             and r["context"] == c and r["tpot_slo_ms"] == t and r["optimization"] == opt_last),
                            key=lambda r: r["bandwidth_gbps"])  # fmt: skip
                ax.plot([r["bandwidth_gbps"] for r in rs], [r["throughput_per_cost"] for r in rs], marker=_MARKERS[topo],
                        ms=3, color=_COLORS[topo], label=topo)  # fmt: skip
            _log_ticks(ax, [r["bandwidth_gbps"] for r in recs if r["num_xpus"] == n_ref])
            ax.set_title(f"TPOT {t:g} ms, context {c}", fontsize=9)
            ax.set_xlabel("bandwidth per XPU (GB/s)")
            ax.set_ylabel("tokens/s per XPU / norm. cost")
            ax.legend(fontsize=7)
    written.append(save_png(fig, out / "bandwidth_topologies.png"))
    plt.close(fig)

    if a.get("topology"):
        import numpy as np

        keys = list(a["topology"])
        opts = result["config"]["optimizations"]
        topos = result["config"]["topologies"]
        fig, axes = plt.subplots(1, len(opts), figsize=(5 * len(opts), 3.6), squeeze=False)
        fig.suptitle(f"Throughput per cost relative to scale-up, 1x provision, {n_ref} XPUs")
        w = 0.8 / len(topos)
        for k, opt in enumerate(opts):
            ax = axes[0][k]
            for ti, topo in enumerate(topos):
                vals = []
                for key in keys:
                    row = a["topology"][key].get(opt, {})
                    su = row.get("scale-up", {}).get("throughput_per_cost", 0)
                    vals.append(row[topo]["throughput_per_cost"] / su if topo in row and su > 0 else 0)
                ax.bar(np.arange(len(keys)) + ti * w, vals, w, color=_COLORS[topo], label=topo)
            ax.axhline(1, color="k", lw=0.6)
            ax.set_xticks(np.arange(len(keys)) + 0.4 - w / 2)
            ax.set_xticklabels([k.replace("_", "\n") for k in keys], fontsize=7)
            ax.set_title(opt, fontsize=9)
            ax.legend(fontsize=7)
        written.append(save_png(fig, out / "topologies_1x.png"))
        plt.close(fig)

    if a.get("pareto"):
        fig, axes, cfg = _grid(plt, result, f"Performance vs cost per XPU ({a['pareto'][next(iter(a['pareto']))]['optimization']}), "
                               "Pareto frontier")  # fmt: skip
        for i, c in enumerate(cfg["contexts"]):
            for j, t in enumerate(cfg["tpots_ms"]):
                ax = axes[i][j]
                pts = a["pareto"][_key(t, c)]["points"]
                for topo in cfg["topologies"]:
                    ps = [p for p in pts if p["topology"] == topo]
                    ax.scatter([p["cost_per_xpu"] for p in ps], [p["throughput_per_xpu"] for p in ps], s=14,
                               marker=_MARKERS[topo], color=_COLORS[topo], label=topo)  # fmt: skip
                front = sorted((p for p in pts if p.get("on_frontier")), key=lambda p: p["cost_per_xpu"])
                ax.plot([p["cost_per_xpu"] for p in front], [p["throughput_per_xpu"] for p in front], "k-", lw=0.8)
                ax.set_title(f"TPOT {t:g} ms, context {c}", fontsize=9)
                ax.set_xlabel("normalised cost per XPU")
                ax.set_ylabel("tokens/s per XPU")
                ax.legend(fontsize=7)
        written.append(save_png(fig, out / "pareto.png"))
        plt.close(fig)

    if a.get("variants"):
        import numpy as np

        vnames = [v["name"] for v in result["config"]["variants"] if v["name"] != "baseline"]
        fig, axes, cfg = _grid(plt, result, f"Variant gain in throughput per cost over baseline (1x provision, {n_ref} XPUs)")
        for i, c in enumerate(cfg["contexts"]):
            for j, t in enumerate(cfg["tpots_ms"]):
                ax = axes[i][j]
                per = a["variants"].get(_key(t, c), {})
                topos = list(per)
                w = 0.8 / max(1, len(vnames))
                for vi, v in enumerate(vnames):
                    ax.bar(np.arange(len(topos)) + vi * w, [per[tp].get(v, 0) * 100 for tp in topos], w, label=v)
                ax.set_xticks(np.arange(len(topos)) + 0.4 - w / 2)
                ax.set_xticklabels(topos, fontsize=7)
                ax.set_ylabel("gain (%)")
                ax.set_title(f"TPOT {t:g} ms, context {c}", fontsize=9)
                ax.legend(fontsize=6)
        written.append(save_png(fig, out / "variants.png"))
        plt.close(fig)

    gens = a.get("generations")
    if gens:
        names = list(gens)
        keys = list(gens[names[0]]["scenarios"])
        fig, axes = plt.subplots(len(names), len(keys), figsize=(3.8 * len(keys), 3.0 * len(names)), squeeze=False)
        fig.suptitle(f"Throughput per XPU vs bandwidth on projected GPUs ({result['config']['generation_size']} XPUs, dbo+sd)")
        for i, g in enumerate(names):
            for j, key in enumerate(keys):
                ax = axes[i][j]
                sc = gens[g]["scenarios"][key]
                for topo, thr in sc["throughput_per_xpu"].items():
                    ax.plot(gens[g]["bandwidths_gbps"], thr, marker=_MARKERS[topo], ms=3, color=_COLORS[topo], label=topo)
                ax.axvline(gens[g]["provision_gbps"], color="k", lw=0.5, ls=":")
                _log_ticks(ax, gens[g]["bandwidths_gbps"])
                ax.set_title(f"{g}: {key}", fontsize=8)
                ax.set_xlabel("bandwidth per XPU (GB/s)", fontsize=8)
                ax.set_ylabel("tokens/s per XPU", fontsize=8)
                ax.legend(fontsize=6)
        written.append(save_png(fig, out / "generations.png"))
        plt.close(fig)
    return written
