"""Test scheduling for ``make test`` (``pytest -n 3 --dist loadfile``: every test, three workers).

pytest-xdist's ``loadfile`` hands out whole files, one as a worker frees up (a file's module
fixtures are built once), ordered by how many tests each file has. Here the order is by measured
time instead: the longest end-to-end files (``--durations``) first, longest first, the rest in
collection order, so that no long file starts last and finishes alone. The guide pages are the
exception to one file, one unit: each page runs in its own fresh copy of the repository and
shares nothing, so each is a unit of its own (together they take longer than any file).
A stale list only costs balance, never correctness.
"""

from __future__ import annotations

import pytest

GUIDES = "tests/docs/test_guides.py::test_guide["
LONGEST_FIRST = [  # work units by measured time (2 cores, two busy workers: 401 .. 58 s)
    "tests/serving/test_mla_tp.py",
    "tests/serving/test_serving_cases.py",
    "tests/semmoe/test_server_scheduling.py",
    "tests/serving/test_bench_serve.py",
    "tests/training/test_watchdog.py",
    "tests/distill/test_report.py",
    "tests/serving/test_serving_chaos.py",
    GUIDES + "semmoe]",
    "tests/training/test_pretrain.py",
    GUIDES + "peers]",
    "tests/serving/test_lm_eval_server.py",
    GUIDES + "fcsd]",
    "tests/distill/test_fcsd.py",
    "tests/bench/test_peer_deepspeed.py",
    "tests/bench/test_bench_cli.py",
    GUIDES + "bigmac]",
    "tests/training/test_multinode.py",
    "tests/bench/test_ttq.py",
    GUIDES + "bench-serve]",
]


def _scope(nodeid: str) -> str:
    """A guide page's test on its own (each runs in a fresh copy and shares nothing), else its file."""
    return nodeid if nodeid.startswith(GUIDES) else nodeid.split("::")[0]


def pytest_collection_modifyitems(config, items):
    rank = {scope: i for i, scope in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_scope(item.nodeid), len(rank)))  # stable: the rest in order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (the dev extra)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` in the order above (not xdist's most-tests-first), each guide page apart."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    config.option.loadscopereorder = False
    return LongestFirst(config, log)
