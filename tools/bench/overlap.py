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
"""

from __future__ import annotations

import collections
from typing import Iterable, Optional

from moe_variants.common.comm import BusyTime

__all__ = ["events_from_timeline", "collectives", "direction_totals", "summarize"]


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
