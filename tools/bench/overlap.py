"""Where a step's all-to-all time went: per collective and per direction, from a timeline.

The events are a ``TimelineRecorder``'s (``moe_variants/common/comm.py``): ``comm`` (a collective
in flight, launch to completion), ``wait`` (the main thread blocked on one, ``wait <name>``) and
FarSkip's compute ``phases``. Times are milliseconds.

Per collective: ``in_flight``, ``exposed`` (the main thread waited for it) and ``window`` (launch to
its wait: the compute the schedule placed behind it, plus any time blocked on another collective).

Per direction (forward, backward): ``overlap = 1 - exposed / in flight``, in flight being the union
of the intervals (collectives flying together count once, as in the benchmark's counters), and its
**bound** ``min(1, W / in flight)``, where ``W`` is the compute the schedule places inside the
collectives' windows (the union of the windows minus the time blocked in them): the paper's Eq. 9
view, ``T_dispatch + T_combine <= T_overlappable``, with this step's measured compute. Every
millisecond of compute with a collective in flight lies in that collective's window, so
``overlap <= bound``; ``overlap / bound`` is how much of what the schedule offers the
implementation hides (below 1 when windows and collectives are mismatched: one collective's
window has slack while another's is too short).

Across ranks (``transfer_skew``): an all-to-all completes on every rank at about the same time,
once the last rank has entered it and the data have crossed the link, so the rank that entered last
spends the least time in it. Per collective, its **transfer** time is the shortest in-flight time
over the ranks; on each rank the first ``in-flight - transfer`` of it is **rank-skew wait** (the
rank entered that much before the last one) and the rest transfer. Per step and rank, transfer
time is the union of the transfer parts, skew the in-flight union minus it, so ``transfer + skew``
is the in-flight time of the counters. Only each rank's own durations are compared, so the ranks'
clocks need not agree (GPU event clocks, other hosts).
"""

from __future__ import annotations

import collections
from typing import Iterable, Optional, Sequence

from moe_variants.common.comm import BusyTime

__all__ = ["events_from_timeline", "collectives", "direction_totals", "summarize", "comm_spans",
           "transfer_skew", "transfer_skew_steps"]


def events_from_timeline(timeline) -> list[dict]:
    """A ``TimelineRecorder``'s events as dicts with times in ms."""
    return [{"name": n, "lane": lane, "start": s * 1e3, "end": e * 1e3} for n, lane, s, e in timeline.events]


def collectives(events: list[dict]) -> list[dict]:
    """Each collective with its in-flight time, exposed (waited) time and window, in ms."""
    waits = collections.defaultdict(list)
    for e in events:
        if e["lane"] == "wait" and e["name"].startswith("wait "):
            waits[e["name"][5:]].append(e)
    out = []
    for e in sorted((e for e in events if e["lane"] == "comm"), key=lambda e: e["start"]):
        # its wait: the first of that name to end at or after its completion (a wait that did not
        # block starts after the completion; earlier layers' waits ended before it was launched)
        mine = [w for w in waits[e["name"]] if w["end"] >= e["end"] - 1e-3 and w["start"] >= e["start"] - 1e-3]
        wait = min(mine, key=lambda w: w["end"]) if mine else None
        in_flight = e["end"] - e["start"]
        exposed = max(0.0, e["end"] - max(wait["start"], e["start"])) if wait else 0.0
        window = max(0.0, wait["start"] - e["start"]) if wait else in_flight
        out.append({"name": e["name"], "backward": e["name"].endswith(" bwd"), "start_ms": e["start"],
                    "in_flight_ms": in_flight, "exposed_ms": exposed, "window_ms": window})
    return out


def _spans(intervals: Iterable[tuple[float, float]]) -> BusyTime:
    busy = BusyTime()
    for start, end in intervals:
        busy.add(start, end)
    return busy


def _intersection(a: BusyTime, b: BusyTime) -> float:
    """Length of the intersection of two unions of intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(a.spans) and j < len(b.spans):
        lo, hi = max(a.spans[i][0], b.spans[j][0]), min(a.spans[i][1], b.spans[j][1])
        total += max(0.0, hi - lo)
        if a.spans[i][1] < b.spans[j][1]:
            i += 1
        else:
            j += 1
    return total


def direction_totals(events: list[dict], rows: Optional[list[dict]] = None) -> dict:
    """``{"forward"|"backward": {in_flight_ms, exposed_ms, window_compute_ms, overlap, bound}}``."""
    rows = collectives(events) if rows is None else rows
    blocked = _spans((e["start"], e["end"]) for e in events if e["lane"] == "wait" and e["end"] > e["start"])
    out = {}
    for name, backward in (("forward", False), ("backward", True)):
        mine = [r for r in rows if r["backward"] == backward]
        in_flight = _spans((r["start_ms"], r["start_ms"] + r["in_flight_ms"]) for r in mine).total
        windows = _spans((r["start_ms"], r["start_ms"] + r["window_ms"]) for r in mine)
        compute = windows.total - _intersection(windows, blocked)
        exposed = sum(r["exposed_ms"] for r in mine)
        out[name] = {
            "in_flight_ms": in_flight,
            "exposed_ms": exposed,
            "window_compute_ms": compute,
            "overlap": 1.0 - exposed / in_flight if in_flight else None,
            "bound": min(1.0, compute / in_flight) if in_flight else None,
        }
    return out


def summarize(events: list[dict]) -> dict:
    """Step time, per-direction totals, per-kind sums, FarSkip's forward phases and every collective."""
    rows = collectives(events)
    kinds = collections.OrderedDict()
    for r in rows:
        k = kinds.setdefault(r["name"], {"count": 0, "exposed_count": 0, "in_flight_ms": 0.0, "exposed_ms": 0.0,
                                         "window_ms": 0.0})
        k["count"] += 1
        k["exposed_count"] += r["exposed_ms"] > 0.5  # waited on for more than half a millisecond
        for key in ("in_flight_ms", "exposed_ms", "window_ms"):
            k[key] += r[key]
    phases = collections.OrderedDict()
    for e in events:
        if e["lane"] == "phases" and e["end"] > e["start"]:
            base = e["name"].rsplit(" L", 1)[0]
            phases[base] = phases.get(base, 0.0) + e["end"] - e["start"]
    step = [e for e in events if e["lane"] == "step"]
    return {"step_ms": step[0]["end"] - step[0]["start"] if step else None,
            "directions": direction_totals(events, rows), "kinds": kinds, "forward_phases_ms": phases,
            "collectives": rows}


def comm_spans(timeline) -> list:
    """A ``TimelineRecorder``'s collectives as ``[name, start_s, end_s]``, in launch order."""
    return [[n, s, e] for n, lane, s, e in sorted(timeline.events, key=lambda ev: ev[2]) if lane == "comm"]


def transfer_skew(spans_by_rank: Sequence[Sequence[Sequence]]) -> Optional[list]:
    """Transfer time and rank-skew wait of one step (module docstring), per rank.

    ``spans_by_rank[r]`` lists rank r's collectives of the step as ``(name, start_s, end_s)`` (any
    order; matched across ranks by launch order). Returns ``[{"in_flight_s", "transfer_s",
    "skew_s"}]`` per rank, or None when the ranks do not list the same collectives."""
    ordered = [sorted(((str(n), float(s), float(e)) for n, s, e in spans), key=lambda x: x[1]) for spans in spans_by_rank]
    if not ordered or any([n for n, _, _ in o] != [n for n, _, _ in ordered[0]] for o in ordered):
        return None
    shortest = [min(o[i][2] - o[i][1] for o in ordered) for i in range(len(ordered[0]))]
    out = []
    for o in ordered:
        flight = _spans((s, e) for _, s, e in o).total
        transfer = _spans((max(s, e - t), e) for (_, s, e), t in zip(o, shortest)).total
        out.append({"in_flight_s": flight, "transfer_s": transfer, "skew_s": flight - transfer})
    return out


def transfer_skew_steps(steps_by_rank: Sequence[Sequence[Sequence[Sequence]]]) -> Optional[list]:
    """``transfer_skew`` of every step: ``steps_by_rank[r][k]`` is rank r's spans of step k. Returns
    per rank ``{"transfer_s": [per step], "skew_s": [per step]}``, or None when the ranks recorded
    different numbers of steps or collectives."""
    if not steps_by_rank or any(len(steps) != len(steps_by_rank[0]) for steps in steps_by_rank):
        return None
    out = [{"transfer_s": [], "skew_s": []} for _ in steps_by_rank]
    for k in range(len(steps_by_rank[0])):
        split = transfer_skew([steps[k] for steps in steps_by_rank])
        if split is None:
            return None
        for acc, s in zip(out, split):
            acc["transfer_s"].append(s["transfer_s"])
            acc["skew_s"].append(s["skew_s"])
    return out
