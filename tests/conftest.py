"""Test ordering for the slow tier's two workers (``make test``: ``pytest -n 2 --dist loadfile``).

pytest-xdist hands out whole files in collection order, one as a worker frees up, so a long file
collected last finishes alone while the other worker idles. The longest end-to-end files (measured
with ``--durations``) are moved to the front, longest first; the rest keep their order. A stale list
only costs balance, never correctness.
"""

from __future__ import annotations

LONGEST_FIRST = [  # seconds on 2 cores, both workers busy: 580, 385, 264, 236, 208, 139, 131, 123, 103, 96
    "tests/docs/test_guides.py",
    "tests/serving/test_mla_tp.py",
    "tests/serving/test_serving_cases.py",
    "tests/serving/test_bench_serve.py",
    "tests/semmoe/test_server_scheduling.py",
    "tests/training/test_watchdog.py",
    "tests/serving/test_serving_chaos.py",
    "tests/training/test_pretrain.py",
    "tests/distill/test_report.py",
    "tests/serving/test_lm_eval_server.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest in order
