"""The serving end-to-end cases as one table (``tools/faults/serving_cases.py``: ``TABLE``), one test
per server: the documented ``--nproc-per-node 2 --max-restarts`` command or plain torchrun, a fixed
``--port`` or 0, EP 2, TP 2 (the tiny standard checkpoint) or MLA at EP 2 (``mla_ckpt``); kill -9,
SIGSTOP, a segfault and an exception in the forward of rank 0 and of rank 1, and a rank hung before
it loads anything. Each case asserts what a user expects. Under the front end with a restart left:
a non-streamed greedy request and a seeded sampled one in flight at the readme-fixed-port run's
kill -9 of rank 1 are held and answered 200 by the restarted engine with the tokens they gave
before the fault (exact: the same weights, greedy or the request's own seed), each sent again once
(``/metrics``); a stream in flight at the other faults, once started, ends with an error event
within the stall timeout plus 10 s; then the same URL answers again within 120 s with the greedy
tokens of before the first fault. Under torchrun, or with no restart left: the request in flight
answered with a clean 503 within the stall or watchdog timeout plus 10 s, then the launcher exiting
non-zero within 60 s (plus torchrun's 30 s for a stopped rank). A SIGTERM drains the request in
flight (200) and exits 0. The bounds carry slack for a loaded 2-core machine. The readme-fixed-port
run is the README's command on a fixed port: before the front end owned the port, every restarted
rank 0 failed its bind check and the server never came back; before requests were held, its
kill -9 answered the requests in flight with a 503.

The fast checks: the table covers every pair of its factors' values, and the results page shows
the table of the committed run (docs/figures/serving_cases.json) as ``render_markdown`` makes it.
"""

from __future__ import annotations

import json
import os

import pytest

from tools.faults.serving_cases import TABLE, missing_pairs, render_markdown, run_one

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIGURE = os.path.join(REPO, "docs", "figures", "serving_cases.json")


@pytest.mark.slow
@pytest.mark.parametrize("run", TABLE, ids=lambda run: run.name)
def test_serving_case(run, serve_ckpts, mla_ckpt, tmp_path):
    result = run_one(run, {"load": serve_ckpts["standard"], "mla_load": mla_ckpt}, str(tmp_path))
    failed = [c for c in result["cases"] if not c["ok"]]
    log = open(result["log"], errors="replace").read()[-4000:]
    assert not failed and len(result["cases"]) == run.num_cases, (failed or result["cases"], log)


def test_the_table_covers_every_pair_of_factor_values():
    assert missing_pairs() == []
    assert sum(len(run.faults) for run in TABLE) == 14


def test_the_results_page_shows_the_committed_run():
    with open(FIGURE) as f:
        result = json.load(f)
    assert [run["name"] for run in result["runs"]] == [run.name for run in TABLE]
    assert [len(run["cases"]) for run in result["runs"]] == [run.num_cases for run in TABLE]
    with open(os.path.join(REPO, "docs", "results", "faults.md")) as f:
        assert render_markdown(result) in f.read()
