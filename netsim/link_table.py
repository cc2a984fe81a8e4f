"""The run's own link, as calibrated: collective seconds by size, rest and direction (``LinkTable``).

``scripts/calibrate_link_table.sh`` times gloo all-to-alls on the shaped link at the run's rate
(``scripts/bench_ep.py --collectives``), once per idle gap before each call (``--gap-ms``), both
ways (every rank sends) and one way (``--one-way``: only rank 0 sends), and, for a
tensor-parallel run, all-reduces after the same gaps. The shaper (``tc tbf``, its bucket at least
64 KiB) and TCP make a call's time depend on its size, on how long the link rested before it, and
on whether the link also carries traffic the other way, in ways one alpha-beta line through
back-to-back calls misses. On the 0.0665 Gbit/s link: 64 KiB off-rank takes 8 ms back to back and
under 1 ms after a 10 ms rest; 256 KiB and more run at the nominal rate one way and at about half
of it both ways. ``netsim.replay.step_all_to_all_s`` times a step's calls from this table.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from megatron.common.cli import UserError

__all__ = ["LinkTable"]


@dataclasses.dataclass(frozen=True)
class LinkTable:
    """Seconds of one call on the run's link. ``gaps_s[i]`` has the curve ``curves[i]`` (both ways)
    of (off-rank bytes a rank sends, seconds), sorted by bytes; ``one_way_gaps_s``/``one_way_curves``
    the same one way; ``allreduce_*`` gloo all-reduces of a tensor of so many bytes on every rank
    (a tensor-parallel run's reductions; empty where the table has none). A call costs the
    calibration's mean over its repeats: a step costs the sum of its calls, and small calls' times
    are skewed (at 0.08 Gbit/s after 5 ms rests, 8 KiB took 0.42 ms in the median and 1.14 ms on
    average)."""

    ranks: int
    gbit: float
    gaps_s: tuple
    curves: tuple
    one_way_gaps_s: tuple
    one_way_curves: tuple
    allreduce_gaps_s: tuple = ()  # all-reduces (``--ops all_reduce``): (tensor bytes, seconds) per gap
    allreduce_curves: tuple = ()

    @property
    def smallest_bytes(self) -> float:
        return self.curves[0][0][0]

    @property
    def bytes_per_s(self) -> float:
        return self.gbit * 1e9 / 8

    @property
    def bucket_s(self) -> float:
        """Seconds of rest that fill the shaper's bucket: ``tools/bench/netns.py`` gives ``tc tbf`` a
        burst of 64 KiB plus one frame, or 1 ms of traffic where that is more."""
        return max(64 * 1024 + 1514, self.bytes_per_s / 1000) / self.bytes_per_s

    def seconds(self, sent: float, received: float, gap_s: float) -> float:
        """One call whose busiest link carries ``sent`` bytes one way and ``received`` the other,
        after ``gap_s`` of rest: log-log interpolation in bytes (below the smallest size its time,
        above the largest that size's rate), linear in the gap between measured gaps (clamped), and
        linear between the one-way and both-ways times in ``min/max`` of the two directions."""
        hi, lo = max(sent, received), min(sent, received)
        if hi <= 0 or self.ranks < 2:
            return 0.0
        both = float(np.interp(gap_s, self.gaps_s, [self._curve(c, hi) for c in self.curves]))
        one = float(np.interp(gap_s, self.one_way_gaps_s, [self._curve(c, hi) for c in self.one_way_curves]))
        return one + (both - one) * lo / hi

    def allreduce_seconds(self, tensor_bytes: float, gap_s: float) -> float:
        """One all-reduce of ``tensor_bytes`` on every rank after ``gap_s`` of rest (interpolated as
        ``seconds``); a one-line error when the table has no all-reduce calibration."""
        if tensor_bytes <= 0 or self.ranks < 2:
            return 0.0
        if not self.allreduce_curves:
            raise UserError("--link-table: the run's tensor-parallel all-reduces need all_reduce calibrations "
                            "(scripts/calibrate_link_table.sh writes ar_both_*.csv)")
        return float(np.interp(gap_s, self.allreduce_gaps_s, [self._curve(c, tensor_bytes) for c in self.allreduce_curves]))

    @staticmethod
    def _curve(curve, m: float) -> float:
        xs, ys = [b for b, _ in curve], [t for _, t in curve]
        if m <= xs[0]:
            return ys[0]
        if m >= xs[-1]:
            return ys[-1] * m / xs[-1]
        return float(np.exp(np.interp(math.log(m), np.log(xs), np.log(ys))))

    @classmethod
    def from_calibrations(cls, paths: Sequence[str]) -> LinkTable:
        """Read ``bench_ep.py --collectives`` CSVs (all_to_all or all_reduce rows of one rank count)
        with their sidecar JSONs (link rate, gap, one way or not, and each row's ``mean_s`` over its
        repeats). One-line errors for what does not fit or is missing."""
        import csv
        import json
        import os

        ranks, gbit, tables = None, None, {}
        for path in paths:
            side = os.path.splitext(path)[0] + ".json"
            try:
                with open(side) as f:
                    meta = json.load(f)
                with open(path, newline="") as f:
                    rows = [r for r in csv.DictReader(f) if r.get("op") in ("all_to_all", "all_reduce")]
                g, gap, one_way = float(meta["link"]["gbit"]), float(meta.get("gap_s", 0.0)), bool(meta.get("one_way"))
                counts, ops = {int(r["ranks"]) for r in rows}, {r["op"] for r in rows}
                sizes = [(r["op"], int(r["ranks"]), int(r["bytes"])) for r in rows]
                means = {(m["op"], int(m["bytes"])): float(m["mean_s"]) for m in meta.get("rows", []) if "mean_s" in m}
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ValueError(f"--link-table {path}: not a bench_ep.py --collectives CSV with its sidecar JSON "
                                 f"({err})") from None
            if len(counts) != 1 or len(ops) != 1 or len(sizes) < 2:
                raise ValueError(f"--link-table {path}: needs all_to_all or all_reduce rows (not both) of one rank "
                                 "count at two sizes or more")
            missing = [(op, b) for op, _, b in sizes if (op, b) not in means]
            if missing:
                raise ValueError(f"--link-table {path}: its sidecar JSON has no mean_s (the mean over the repeats) "
                                 f"for {missing[0][0]} of {missing[0][1]} B; calibrate again with "
                                 "scripts/calibrate_link_table.sh")
            kind = "all_reduce" if ops == {"all_reduce"} else "one-way" if one_way else "both-ways"
            share = (lambda n: 1.0) if kind == "all_reduce" else (lambda n: (n - 1) / n)  # off-rank bytes
            curve = tuple(sorted((b * share(n), means[(op, b)]) for op, n, b in sizes))
            count = counts.pop()
            if ranks is not None and (count != ranks or not math.isclose(g, gbit, rel_tol=1e-3)):
                raise ValueError(f"--link-table {path}: {count} ranks at {g:g} Gbit/s; the others are "
                                 f"{ranks} ranks at {gbit:g} Gbit/s")
            if (kind, gap) in tables:
                raise ValueError(f"--link-table {path}: a second {kind} table for the gap {gap * 1e3:g} ms")
            ranks, gbit = count, g
            tables[(kind, gap)] = curve

        def gaps(kind):
            return sorted(gap for k, gap in tables if k == kind)

        if not gaps("both-ways"):
            raise ValueError("--link-table: no both-ways all_to_all calibration given (scripts/calibrate_link_table.sh "
                             "writes a2a_both_*.csv)")
        if not gaps("one-way"):
            raise ValueError("--link-table: no one-way all_to_all calibration given (bench_ep.py --one-way; "
                             "scripts/calibrate_link_table.sh writes a2a_one_*.csv)")
        return cls(ranks, gbit, *((tuple(gaps(k)), tuple(tables[(k, g)] for g in gaps(k)))[i]
                                  for k in ("both-ways", "one-way", "all_reduce") for i in (0, 1)))
