"""A stopped, killed or failing rank makes the whole server fail fast and loudly (two torchrun
ranks, EP=2, gloo, 127.0.0.1; ``tools.faults.serving`` injects the fault into rank 1 while a
request is in flight; ``--stall-timeout 2 --watchdog-timeout 5``, torchrun ``--shutdown-timeout 5``).

- SIGKILL: rank 0's next collective fails at once (gloo sees the closed connection): the waiting
  client gets a 503 naming rank 1 as the rank that exited, the launcher exits non-zero.
- An exception raised on rank 1 after an engine step (the server runs under ``tools.faults.rank
  serve``, whose injector subscribes to the loop's ``STEP_END``) is an engine failure: the waiting
  client gets a 503 naming rank 1 and its error, and the launcher exits non-zero.
- SIGSTOP, and the other faults of rank 0 and rank 1 under both launches, are cases of
  ``test_serving_cases.py`` (one table of servers and faults).

The bounds asserted are the documented ones (docs/results/serving.md) with 5-15 s of slack for a loaded
CI machine; the figures themselves come from ``python -m tools.faults serving``.
"""

from __future__ import annotations

import pytest

from tools.faults.serving import inject_fault

pytestmark = pytest.mark.slow


def test_a_killed_rank_fails_in_flight_requests_at_once(serve_ckpts, tmp_path):
    r = inject_fault(serve_ckpts["standard"], "SIGKILL", str(tmp_path))
    # named as rank 1 (rank 0's gloo error stays in the log: tests/serving/test_failure_reports.py)
    assert r.client_status == 503 and "rank 1 of the engine exited (pid" in r.client_message, r
    assert r.client_answer_s is not None and r.client_answer_s < 10, r
    assert r.launcher_code not in (None, 0) and r.launcher_exit_s < 20, r


def test_an_exception_in_a_rank_fails_in_flight_requests(serve_ckpts, tmp_path):
    r = inject_fault(serve_ckpts["standard"], "error", str(tmp_path))
    assert r.client_status == 503 and "rank 1 of the engine failed (" in r.client_message, r
    assert r.launcher_code not in (None, 0), r
