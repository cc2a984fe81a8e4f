"""What bench_serve shows: the progress line, the serve and prefill tables, where plots go."""

from __future__ import annotations

import os
import sys
import time

from tools.bench.aggregate import format_rows

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


def serve_table(result: dict) -> str:
    header = ("variant", "rate", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "e2e p50/p99 s",
              "goodput", "a2a B/tok", "a2a %", "exposed %", "exp ms/tok", "LAR", "imbal", "speedup")
    rows = []
    for name, s in result["variants"].items():
        ratios = result["ratios"][name].get("rates", {})
        for rate, r in s["rates"].items():
            rows.append((name, rate, _num(r["requests_per_s"]), _num(r["output_tokens_per_s"], "{:.1f}"),
                         f"{_ms(r['ttft_s']['p50'])} / {_ms(r['ttft_s']['p99'])}",
                         f"{_ms(r['tpot_s']['p50'])} / {_ms(r['tpot_s']['p99'])}",
                         f"{_num(r['e2e_s']['p50'])} / {_num(r['e2e_s']['p99'])}",
                         _num(r["goodput_requests_per_s"]), _num(r["a2a_bytes_per_token"], "{:.0f}"),
                         _pct(r["a2a_fraction"]), _pct(r["exposed_fraction"]),
                         _ms(r.get("exposed_a2a_s_per_output_token")), _num(r.get("lar"), "{:.3f}"),
                         _num((r.get("load_imbalance") or {}).get("mean"), "{:.3f}"),
                         _num(ratios.get(rate, {}).get("throughput_speedup"), "{:.3f}")))
    return format_rows(header, rows, left=2)


def prefill_table(result: dict) -> str:
    header = ("variant", "prefill tok/s [min-max]", "fwd tok/s", "TTFT p50 ms", "a2a %", "exposed %", "overlap %",
              "a2a B/tok", "bytes x", "speedup", "fwd speedup", "Amdahl bound")
    rows = []

    def med(stat):
        return stat["median"] if stat else None

    for name, s in result["variants"].items():
        r = result["ratios"][name]
        tput = s["prefill_tokens_per_s"]
        rows.append((name, "-" if tput is None else f"{tput['median']:.0f} [{tput['min']:.0f}-{tput['max']:.0f}]",
                     _num(med(s["forward_tokens_per_s"]), "{:.0f}"), _ms(s["ttft_s"]["p50"]),
                     _pct(med(s["a2a_fraction"])), _pct(med(s["exposed_fraction"])),
                     _pct(s["overlap"]), _num(s["a2a_bytes_per_token"], "{:.0f}"), _num(r["bytes_ratio"], "{:.3f}"),
                     _num(r["throughput_speedup"], "{:.3f}"), _num(r["forward_speedup"], "{:.3f}"),
                     f"{_num(r['amdahl_bound'])} (bytes: {_num(r['amdahl_bound_bytes'])})"))
    return format_rows(header, rows)


def plot_target(args):
    if args.no_plots:
        return None
    if args.plots:
        return args.plots, "bench_serve"
    if args.json:
        stem = os.path.splitext(os.path.basename(args.json))[0]
        return os.path.dirname(os.path.abspath(args.json)), stem
    return None
