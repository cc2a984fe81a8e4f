"""What bench_serve shows: the progress line, the serve and prefill tables, where plots go."""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

from tools.bench.aggregate import format_rows
from tools.bench.discipline import format_ci, interval_name

from .loadgen import samples_needed

__all__ = ["Printer", "serve_table", "prefill_table", "plot_target"]


class Printer:
    """Log lines and the one-line progress display (redrawn in place on a terminal, else a line
    every 15 s)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.width = 0
        self.last = 0.0

    def line(self, text: str) -> None:
        self.clear()
        print(text, file=self.stream, flush=True)

    def progress(self, text: str, force: bool = False) -> None:
        if self.tty:
            self.stream.write("\r" + text.ljust(self.width))
            self.stream.flush()
            self.width = len(text)
        elif force or time.monotonic() - self.last >= 15.0:
            print(text, file=self.stream, flush=True)
            self.last = time.monotonic()

    def clear(self) -> None:
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _num(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.1f}"


def _pq(dist: dict, q: int, scale: float = 1e3, fmt: str = "{:.1f}") -> str:
    """A percentile of a ``distribution``, ``~`` in front when it rests on fewer samples than it
    needs (``loadgen.samples_needed``)."""
    value = dist.get(f"p{q}")
    if value is None:
        return "-"
    return ("~" if dist.get("n", 0) < samples_needed(q) else "") + fmt.format(value * scale)


def _footer(result: dict, loaded: Optional[dict], what: str) -> list:
    lines = []
    runs = result.get("config", {}).get("runs") or 1
    if runs > 1:
        lines.append(f"{what}: medians over {runs} runs [{interval_name(runs)}]; the rest pooled over the runs")
    for name, bad in (loaded or {}).items():
        if bad:
            lines.append(f"* {name}: run(s) {', '.join(str(r + 1) for r in bad)} taken on a loaded machine "
                         "(the JSON's runs[].load says why)")
    return lines


def serve_table(result: dict, loaded: Optional[dict] = None) -> str:
    """One row per variant and rate; latency percentiles pooled over the runs (``~``: fewer samples
    than the percentile needs), output tokens/s and the speedup medians over the runs."""
    header = ("variant", "rate", "n", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "e2e p50/p99 s",
              "goodput", "a2a B/tok", "a2a %", "xfer %", "skew %", "exposed %", "exp ms/tok", "LAR", "imbal",
              "speedup")
    rows, thin = [], False
    for name, s in result["variants"].items():
        ratios = result["ratios"][name].get("rates", {})
        for rate, r in s["rates"].items():
            over = r.get("over_runs") or {}
            ratio = ratios.get(rate, {})
            speedup = (ratio.get("over_runs") or {}).get("throughput_speedup")
            thin |= any(r[k].get("n", 0) < samples_needed(99) for k in ("ttft_s", "tpot_s", "e2e_s"))
            rows.append((name + ("*" if (loaded or {}).get(name) else ""), rate, str(r["num_requests"]),
                         _num(r["requests_per_s"]),
                         format_ci(over.get("output_tokens_per_s")) if over.get("output_tokens_per_s")
                         else _num(r["output_tokens_per_s"], "{:.1f}"),
                         f"{_pq(r['ttft_s'], 50)} / {_pq(r['ttft_s'], 99)}",
                         f"{_pq(r['tpot_s'], 50)} / {_pq(r['tpot_s'], 99)}",
                         f"{_pq(r['e2e_s'], 50, 1.0, '{:.2f}')} / {_pq(r['e2e_s'], 99, 1.0, '{:.2f}')}",
                         _num(r["goodput_requests_per_s"]), _num(r["a2a_bytes_per_token"], "{:.0f}"),
                         _pct(r["a2a_fraction"]), _pct(r.get("transfer_fraction")), _pct(r.get("skew_fraction")),
                         _pct(r["exposed_fraction"]),
                         _ms(r.get("exposed_a2a_s_per_output_token")), _num(r.get("lar"), "{:.3f}"),
                         _num((r.get("load_imbalance") or {}).get("mean"), "{:.3f}"),
                         format_ci(speedup, fmt="{:.3f}") if speedup else
                         _num(ratio.get("throughput_speedup"), "{:.3f}")))
    lines = [format_rows(header, rows, left=2)]
    if thin:
        lines.append(f"~: a percentile from fewer samples than it needs for one to be expected beyond it (p90 "
                     f"{samples_needed(90)}, p99 {samples_needed(99)}); n: requests per rate over all runs")
    lines += _bound_lines(result)
    return "\n".join(lines + _footer(result, loaded, "out tok/s and speedup"))


def _bound_lines(result: dict) -> list:
    """At the highest finite rate (where the baseline saturates, if anywhere): each variant's
    speedup as a fraction of the all-hidden bound (``analysis.serve_bounds``)."""
    names = list(result["ratios"])
    rates = [r for r in (result["ratios"][names[0]].get("rates") or {}) if r != "inf"]
    if not rates:
        return []
    rate = max(rates, key=float)
    first = result["ratios"][names[0]]["rates"][rate]
    if first.get("all_hidden_bound") is None:
        return []
    parts = [f"{n} {_num(result['ratios'][n]['rates'][rate].get('fraction_of_bound'), '{:.2f}')}"
             for n in names if rate in (result["ratios"][n].get("rates") or {})]
    lines = [f"all-hidden bound at rate {rate}: {first['all_hidden_bound']:.2f}x ({names[0]}'s "
             f"{first['amdahl_basis']} share {first['baseline_share']:.2f} removed); speedup / bound: "
             + ", ".join(parts)]
    saved = [(n, result["ratios"][n]["rates"][rate]) for n in names[1:]
             if (result["ratios"][n].get("rates") or {}).get(rate, {}).get("bytes_bound") is not None]
    if saved:
        lines.append(f"bound from the bytes saved at rate {rate} (bytes ratio; bound; speedup / bound): " + ", ".join(
            f"{n} {r['bytes_ratio']:.3f}; {r['bytes_bound']:.2f}x; {_num(r['fraction_of_bytes_bound'])}"
            for n, r in saved))
    return lines


def prefill_table(result: dict, loaded: Optional[dict] = None) -> str:
    """One row per variant: prefill tokens/s median over the runs [``interval_name``] (one run: over its
    bursts [min-max]); the all-to-all share in flight, split into transfer and rank-skew wait; the
    Amdahl bound on the baseline's transfer share (its in-flight share without the split)."""
    header = ("variant", "prefill tok/s", "fwd tok/s", "TTFT p50 ms", "a2a %", "xfer %", "skew %", "exposed %",
              "overlap %", "a2a B/tok", "bytes x", "speedup", "fwd speedup", "Amdahl bound")
    rows = []

    def med(stat):
        return stat["median"] if stat else None

    for name, s in result["variants"].items():
        r = result["ratios"][name]
        over, ratio_over = s.get("over_runs") or {}, r.get("over_runs") or {}
        tput = s["prefill_tokens_per_s"]
        several = (over.get("prefill_tokens_per_s") or {}).get("n", 1) > 1
        rows.append((name + ("*" if (loaded or {}).get(name) else ""),
                     format_ci(over["prefill_tokens_per_s"], fmt="{:.0f}") if several else
                     "-" if tput is None else f"{tput['median']:.0f} [{tput['min']:.0f}-{tput['max']:.0f}]",
                     _num(med(s["forward_tokens_per_s"]), "{:.0f}"), _ms(s["ttft_s"]["p50"]),
                     _pct(med(s["a2a_fraction"])), _pct(med(s.get("transfer_fraction"))),
                     _pct(med(s.get("skew_fraction"))), _pct(med(s["exposed_fraction"])),
                     _pct(s["overlap"]), _num(s["a2a_bytes_per_token"], "{:.0f}"), _num(r["bytes_ratio"], "{:.3f}"),
                     format_ci(ratio_over["throughput_speedup"], fmt="{:.3f}") if several and
                     ratio_over.get("throughput_speedup") else _num(r["throughput_speedup"], "{:.3f}"),
                     _num(r["forward_speedup"], "{:.3f}"),
                     f"{_num(r['amdahl_bound'])} (bytes: {_num(r['amdahl_bound_bytes'])})"))
    base = next(iter(result["ratios"].values()), {})
    lines = [format_rows(header, rows),
             f"Amdahl bound: the baseline's {base.get('amdahl_basis', 'in flight')} share removed (bytes: scaled "
             "by the bytes ratio)"]
    return "\n".join(lines + _footer(result, loaded, "prefill tok/s and speedup"))


def plot_target(args):
    if args.no_plots:
        return None
    if args.plots:
        return args.plots, "bench_serve"
    if args.json:
        stem = os.path.splitext(os.path.basename(args.json))[0]
        return os.path.dirname(os.path.abspath(args.json)), stem
    return None
