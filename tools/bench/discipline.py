"""Benchmark discipline shared by bench_ep, bench_serve and time_to_quality (pure, standard library
and numpy; the load sampler reads ``/proc``).

* ``median_ci``  the median of per-run figures with an interval: at ``BOOTSTRAP_MIN_RUNS`` (5) runs
  or more the percentile-bootstrap interval (resample the runs with replacement ``reps`` times, take
  each resample's median, report the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of those
  medians; deterministic given ``seed``), below that the range of the runs (min-max), which is what
  a 95% bootstrap gives there (each value is a resample median with probability > 2.5%): it says how
  far the runs disagree, not more. ``interval_kind`` in the dict and ``interval_name`` in tables and
  plots say which; a dict without ``interval_kind`` (files written before it) follows the same rule
  by its ``n``.
* ``rotations``  the variant order of each run: run ``r`` uses the order rotated left by ``r``, so
  over ``len(variants)`` runs every variant takes every position once (drift in the machine's speed
  over a run then does not favour the variant that always goes first).
* ``machine_load``  the 1-minute load average and the CPUs that processes *other than this process
  tree* kept busy over a short window: ``(busy jiffies of /proc/stat - jiffies of our tree) /
  (ticks per s x window)``. Sampled between launches, while the harness's own ranks are not running.
* ``LoadGate``  the rule that marks a run as taken on a loaded machine (the JSON and the tables
  carry the mark; ``--strict`` refuses instead): in the sample before or after the run, the load
  average exceeds ``expected + threshold`` (``expected``: the harness's own processes, ranks x
  threads, which the 1-minute average still remembers after a run) or other processes kept more
  than ``threshold`` CPUs busy.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Optional, Sequence

from megatron.common.cli import UserError

__all__ = ["median_ci", "interval_name", "BOOTSTRAP_MIN_RUNS", "over_runs", "paired_ratios", "rotations",
           "machine_load", "cpu_counts", "load_from_counts", "LoadGate", "LoadRefused", "format_ci",
           "DEFAULT_LOAD_THRESHOLD", "DEFAULT_RUNS", "add_discipline_arguments"]

DEFAULT_RUNS = 3
DEFAULT_LOAD_THRESHOLD = 1.3
DEFAULT_REPS = 2000
BOOTSTRAP_MIN_RUNS = 5  # below this the interval is the range of the runs


def median_ci(values: Sequence[float], level: float = 0.95, reps: int = DEFAULT_REPS, seed: int = 0) -> dict:
    """``{"median", "ci_low", "ci_high", "level", "n", "values", "interval_kind"}``: the median of
    ``values`` (one per run) and its interval, ``interval_kind`` "bootstrap" (at ``level``) or, below
    ``BOOTSTRAP_MIN_RUNS`` runs, "range" (min-max; ``level`` None). See the module docstring."""
    import numpy as np

    x = np.asarray([float(v) for v in values], dtype=np.float64)
    if x.size == 0:
        raise ValueError("no values for a median")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    median = float(np.median(x))
    if x.size < BOOTSTRAP_MIN_RUNS:
        kind, level, low, high = "range", None, float(x.min()), float(x.max())
    else:
        rng = np.random.default_rng(seed)
        medians = np.median(x[rng.integers(0, x.size, size=(reps, x.size))], axis=1)
        kind = "bootstrap"
        low, high = (float(q) for q in np.quantile(medians, [(1 - level) / 2, (1 + level) / 2]))
    return {"median": median, "ci_low": low, "ci_high": high, "level": level, "n": int(x.size),
            "values": [float(v) for v in x], "interval_kind": kind}


def interval_name(n: int, level: float = 0.95, unit: str = "run") -> str:
    """What the interval of a median over ``n`` runs (or seeds: ``unit``) is, in words, for table
    headers and plots."""
    if n < BOOTSTRAP_MIN_RUNS:
        return f"range of {n} {unit}{'' if n == 1 else 's'}"
    return f"{level:.0%} bootstrap interval of the median, n = {n}"


def over_runs(per_run: Sequence[dict], keys: Sequence[str], seed: int = 0) -> dict:
    """``{key: median_ci(...)}`` of the figures ``key`` of each run's record (runs where it is None
    are left out; a key no run has is None)."""
    out = {}
    for key in keys:
        values = [r.get(key) for r in per_run]
        values = [v for v in values if v is not None and math.isfinite(v)]
        out[key] = median_ci(values, seed=seed) if values else None
    return out


def paired_ratios(numerators: Sequence[Optional[float]], denominators: Sequence[Optional[float]]) -> list:
    """Per run ``num / den`` (runs where either is missing or the denominator is 0 left out): a
    variant's ratio to the baseline within each run, where both ran side by side."""
    if len(numerators) != len(denominators):
        raise ValueError("paired ratios need one value of each per run")
    return [n / d for n, d in zip(numerators, denominators) if n is not None and d]


def rotations(variants: Sequence[str], runs: int, start: int = 0) -> list:
    """The variant order of each of ``runs`` runs: run ``r`` is ``variants`` rotated left by
    ``start + r`` (``start``: where a series of separate invocations, e.g. one per seed, continues)."""
    if runs < 1:
        raise UserError(f"--runs must be >= 1, got {runs}")
    names = list(variants)
    if not names:
        raise ValueError("no variants to order")
    return [names[(start + r) % len(names):] + names[:(start + r) % len(names)] for r in range(runs)]


def format_ci(stat: Optional[dict], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    """``median [low-high]`` of a ``median_ci`` dict scaled by ``scale``; the median alone for one run."""
    if not stat:
        return "-"
    text = fmt.format(stat["median"] * scale)
    if stat["n"] > 1:
        text += f" [{fmt.format(stat['ci_low'] * scale)}-{fmt.format(stat['ci_high'] * scale)}]"
    return text


# ------------------------------------------------------------------------------------ the load


def cpu_counts(proc: str = "/proc", root_pid: Optional[int] = None) -> dict:
    """One sample: ``{"busy": busy jiffies of all CPUs, "tree": jiffies of the process tree under
    ``root_pid`` (utime + stime + the reaped children's), "loadavg": [1, 5, 15]}``."""
    root_pid = os.getpid() if root_pid is None else root_pid
    with open(os.path.join(proc, "stat")) as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is already inside user)
    busy = sum(fields[:8]) - fields[3] - fields[4]
    with open(os.path.join(proc, "loadavg")) as f:
        loadavg = [float(v) for v in f.read().split()[:3]]
    parent, jiffies = {}, {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                text = f.read()
        except OSError:  # exited meanwhile
            continue
        rest = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
        pid = int(name)
        parent[pid] = int(rest[1])
        jiffies[pid] = sum(int(v) for v in rest[11:15])  # utime stime cutime cstime
    tree = 0
    for pid, j in jiffies.items():
        p, seen = pid, 0
        while p and p != root_pid and seen < 4096:
            p, seen = parent.get(p, 0), seen + 1
        if p == root_pid:
            tree += j
    return {"busy": busy, "tree": tree, "loadavg": loadavg}


def load_from_counts(first: dict, second: dict, window_s: float, ticks_per_s: float, num_cpus: int) -> dict:
    """The load between two ``cpu_counts`` samples ``window_s`` apart: ``other_cpus`` (CPUs kept busy
    by processes outside our tree, >= 0), ``other_share`` (of all CPUs) and the later load average."""
    if window_s <= 0:
        raise ValueError("the sampling window must be > 0")
    other = (second["busy"] - first["busy"]) - (second["tree"] - first["tree"])
    other_cpus = max(0.0, other / ticks_per_s / window_s)
    return {"loadavg_1_5_15": list(second["loadavg"]), "other_cpus": other_cpus,
            "other_share": other_cpus / num_cpus, "window_s": window_s, "time": time.time()}


def machine_load(window_s: float = 0.5, *, proc: str = "/proc", root_pid: Optional[int] = None,
                 sleep: Callable[[float], None] = time.sleep, num_cpus: Optional[int] = None) -> dict:
    """Sample the load now (see ``load_from_counts``); ``sleep`` waits the window (tests inject one
    that changes a fake ``proc`` between the two samples)."""
    first = cpu_counts(proc, root_pid)
    sleep(window_s)
    second = cpu_counts(proc, root_pid)
    return load_from_counts(first, second, window_s, float(os.sysconf("SC_CLK_TCK")),
                            num_cpus or os.cpu_count() or 1)


class LoadRefused(ValueError):
    """``--strict``: a run would be (or was) taken on a loaded machine."""


class LoadGate:
    """Marks (or, ``strict``, refuses) runs taken on a loaded machine (the rule: module docstring).

    ``expected`` is the harness's own load while a run is going (ranks x threads, plus its client);
    ``sample`` defaults to ``machine_load`` (tests inject loads)."""

    def __init__(self, threshold: float = DEFAULT_LOAD_THRESHOLD, expected: float = 0.0, strict: bool = False,
                 sample: Optional[Callable[[], dict]] = None):
        if not threshold >= 0:
            raise UserError(f"--load-threshold must be >= 0, got {threshold}")
        self.threshold, self.expected, self.strict = threshold, expected, strict
        self.sample = sample or (lambda: machine_load())  # looked up when called: tests replace it

    @property
    def rule(self) -> str:
        return (f"loaded: in the sample before or after the run, the 1-minute load average > {self.expected:g} "
                f"(the harness's own processes) + {self.threshold:g}, or other processes kept > {self.threshold:g} "
                "CPUs busy")

    def reasons(self, load: dict) -> list:
        """Why ``load`` counts as loaded (empty: it does not)."""
        out = []
        if load["loadavg_1_5_15"][0] > self.expected + self.threshold:
            out.append(f"load average {load['loadavg_1_5_15'][0]:.2f} > {self.expected:g} + {self.threshold:g}")
        if load["other_cpus"] > self.threshold:
            out.append(f"other processes kept {load['other_cpus']:.2f} CPUs busy > {self.threshold:g}")
        return out

    def before(self, what: str) -> dict:
        """Sample before a run; ``strict`` refuses to start it on a loaded machine."""
        load = self.sample()
        why = self.reasons(load)
        if why and self.strict:
            raise LoadRefused(f"--strict: not starting {what}: {'; '.join(why)}")
        return load

    def after(self, before: dict, what: str) -> dict:
        """Sample after a run: ``{"before", "after", "loaded", "reasons", "threshold", "expected"}``;
        ``strict`` refuses a run whose after-sample is loaded."""
        load = self.sample()
        why = [f"before: {w}" for w in self.reasons(before)] + [f"after: {w}" for w in self.reasons(load)]
        if why and self.strict:
            raise LoadRefused(f"--strict: {what} ran on a loaded machine: {'; '.join(why)}")
        return {"before": before, "after": load, "loaded": bool(why), "reasons": why,
                "threshold": self.threshold, "expected": self.expected}


def add_discipline_arguments(group, *, default_runs: int = DEFAULT_RUNS, runs_help: str = "") -> None:
    """``--runs``, ``--load-threshold`` and ``--strict`` (the same meaning in every harness)."""
    from megatron.common.cli import positive_int

    group.add_argument("--runs", type=positive_int, default=default_runs, metavar="N",
                       help=f"repeat the whole comparison N times, the variant order rotated by one each run; "
                            f"figures are medians over the runs with the range of the runs (fewer than "
                            f"{BOOTSTRAP_MIN_RUNS}) or their 95%% bootstrap interval (default {default_runs})"
                            + (f"; {runs_help}" if runs_help else ""))
    group.add_argument("--load-threshold", type=float, default=DEFAULT_LOAD_THRESHOLD, metavar="CPUS",
                       help="mark a run as loaded when, before or after it, the 1-minute load average exceeds the "
                            "harness's own processes (ranks x threads) by more than this, or other processes keep "
                            f"more than this many CPUs busy (default {DEFAULT_LOAD_THRESHOLD})")
    group.add_argument("--strict", action="store_true", help="refuse (exit 2) instead of marking a loaded run")
