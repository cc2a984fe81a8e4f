"""The per-direction overlap and its Eq. 9 bound from a timeline (tools/bench/overlap.py).

Exact arithmetic on hand-made timelines (times in ms), and the invariant ``overlap <= bound`` on
randomly generated schedules: every millisecond of compute with a collective in flight lies in
that collective's window (launch to wait).
"""

import random

import pytest

from tools.bench.overlap import collectives, direction_totals


def comm(name, start, end):
    return {"name": name, "lane": "comm", "start": start, "end": end}


def wait(name, start, end):
    return {"name": f"wait {name}", "lane": "wait", "start": start, "end": end}


def test_window_too_short_is_the_bound():
    # launched at 0, in flight until 10, the schedule waits at 2: only 2 ms of compute to hide it
    events = [comm("combine", 0, 10), wait("combine", 2, 10)]
    d = direction_totals(events)["forward"]
    assert d["overlap"] == pytest.approx(0.2) and d["bound"] == pytest.approx(0.2)


def test_mismatched_windows_leave_slack():
    # the dispatch's window (4 ms) is too short for its 10 ms; the combine's (10 ms) has 8 ms of slack
    events = [comm("dispatch", 0, 10), wait("dispatch", 4, 10), comm("combine", 20, 22), wait("combine", 30, 30)]
    d = direction_totals(events)["forward"]
    assert d["in_flight_ms"] == pytest.approx(12) and d["exposed_ms"] == pytest.approx(6)
    assert d["overlap"] == pytest.approx(0.5)
    assert d["window_compute_ms"] == pytest.approx(14) and d["bound"] == pytest.approx(1.0)


def test_blocked_time_inside_a_window_is_not_compute():
    # B flies 0-10 with its wait at 10; inside its window the thread blocks on A from 2 to 8
    events = [comm("a", 0, 8), wait("a", 2, 8), comm("b", 0, 10), wait("b", 10, 10)]
    d = direction_totals(events)["forward"]
    assert d["window_compute_ms"] == pytest.approx(4)  # 0-2 and 8-10
    assert d["overlap"] == pytest.approx(0.4) and d["bound"] == pytest.approx(0.4)


def test_backward_collectives_are_their_own_direction():
    events = [comm("combine bwd", 0, 4), wait("combine bwd", 4, 4)]
    d = direction_totals(events)
    assert d["forward"]["overlap"] is None and d["backward"]["overlap"] == pytest.approx(1.0)
    assert [r["backward"] for r in collectives(events)] == [True]


def _random_schedule(rng):
    """One thread alternating compute with launches and waits of collectives of random durations."""
    t, events, inflight = 0.0, [], []
    for i in range(rng.randint(1, 6)):
        t += rng.uniform(0, 3)  # compute
        name = f"c{i}"
        inflight.append((name, t, t + rng.uniform(0.5, 8)))
        if rng.random() < 0.5 or i == 5:
            t += rng.uniform(0, 3)
            name, start, end = inflight.pop(0)
            events.append(comm(name, start, end))
            events.append(wait(name, t, max(t, end)))
            t = max(t, end)
    for name, start, end in inflight:
        t += rng.uniform(0, 2)
        events.append(comm(name, start, end))
        events.append(wait(name, t, max(t, end)))
        t = max(t, end)
    return events


def test_overlap_never_exceeds_the_bound():
    rng = random.Random(0)
    for _ in range(300):
        d = direction_totals(_random_schedule(rng))["forward"]
        assert 0.0 <= d["overlap"] <= d["bound"] + 1e-9 <= 1.0 + 1e-9
