"""``tests/conftest.py``'s scheduling for ``make test``: every work unit it names exists (a renamed file
or guide page would silently fall to the back), guide pages are units of their own and other tests
group by file, and pytest-xdist takes the scheduler in the listed order."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[2]


def test_every_listed_unit_exists():
    pages = {p.stem for p in (ROOT / "docs/guides").glob("*.md")}
    for unit in conftest.LONGEST_FIRST:
        if unit.startswith(conftest.GUIDES):
            assert unit[len(conftest.GUIDES):-1] in pages, unit
        else:
            assert (ROOT / unit).is_file(), unit
    assert len(set(conftest.LONGEST_FIRST)) == len(conftest.LONGEST_FIRST)


def test_guide_pages_are_units_and_other_tests_group_by_file():
    assert conftest._scope("tests/docs/test_guides.py::test_guide[semmoe]") == "tests/docs/test_guides.py::test_guide[semmoe]"
    assert conftest._scope("tests/docs/test_guides.py::test_blocks_are_the_marked_bash_blocks") == "tests/docs/test_guides.py"
    assert conftest._scope("tests/serving/test_mla_tp.py::test_x[mla-ep2]") == "tests/serving/test_mla_tp.py"


def test_xdist_takes_the_listed_order_for_loadfile_only():
    pytest.importorskip("xdist")

    class Option:
        loadscopereorder = True

    class Config:
        option = Option()

        def __init__(self, dist):
            self.dist = dist

        def getvalue(self, name):
            return self.dist

    assert conftest.pytest_xdist_make_scheduler(Config("load"), None) is None
    config = Config("loadfile")
    config.getoption = lambda name, default=None: {"numprocesses": 3, "maxschedchunk": None}.get(name, default)
    config.option.numprocesses = 3
    sched = conftest.pytest_xdist_make_scheduler(config, None)
    assert config.option.loadscopereorder is False  # xdist's most-tests-first order is off
    assert sched._split_scope("tests/docs/test_guides.py::test_guide[fcsd]") == "tests/docs/test_guides.py::test_guide[fcsd]"
