"""netsim.link_table: collective seconds on the run's calibrated link (exact interpolation on
small hand-made calibrations) and the one-line refusals of calibrations that do not fit."""

from __future__ import annotations

import json

import pytest

from netsim.link_table import LinkTable
from tests.netsim.conftest import link_table, table_csv


def test_link_table_interpolates_in_size_rest_and_direction(tmp_path):
    t = link_table(tmp_path)
    assert t.ranks == 2 and t.gaps_s == (0.0, 0.01) and t.one_way_gaps_s == (0.0,)
    assert t.seconds(1000, 1000, 0.0) == pytest.approx(0.001)
    assert t.seconds(2000, 2000, 0.0) == pytest.approx(0.001 * 2 ** 1.5)  # log-log between 1000 B and 4000 B
    assert t.seconds(10, 10, 0.0) == pytest.approx(0.001)  # below the smallest size: its time
    assert t.seconds(8000, 8000, 0.0) == pytest.approx(0.016)  # above the largest: its rate
    assert t.seconds(1000, 1000, 0.005) == pytest.approx(0.00075)  # linear in the rest
    assert t.seconds(1000, 1000, 1.0) == pytest.approx(0.0005)  # clamped at the longest measured rest
    assert t.seconds(4000, 0, 0.0) == pytest.approx(0.004)  # one way
    assert t.seconds(4000, 2000, 0.0) == t.seconds(2000, 4000, 0.0) == pytest.approx(0.006)  # half-way
    assert t.seconds(0, 0, 0.0) == 0.0
    assert t.bucket_s == pytest.approx((64 * 1024 + 1514) / 62.5e6)  # 0.5 Gbit/s: 64 KiB + one frame


def test_a_call_costs_the_mean_of_the_repeats(tmp_path):
    """A step costs the sum of its calls, so a call costs the calibration's mean (the sidecar's
    ``rows[].mean_s``), not the CSV's median."""
    rows = [(2000, 0.003), (8000, 0.009)]
    t = LinkTable.from_calibrations([
        table_csv(tmp_path, "both0", 0.5, 0.0, rows, medians=[0.001, 0.008]),
        table_csv(tmp_path, "one0", 0.5, 0.0, rows, one_way=True, medians=[0.001, 0.008]),
    ])
    assert t.seconds(1000, 1000, 0.0) == pytest.approx(0.003)
    assert t.seconds(4000, 4000, 0.0) == pytest.approx(0.009)


def test_link_table_refuses_what_does_not_fit(tmp_path):
    a = table_csv(tmp_path, "a", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)])
    one = table_csv(tmp_path, "one", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)], one_way=True)
    with pytest.raises(ValueError, match="Gbit/s"):
        LinkTable.from_calibrations([a, table_csv(tmp_path, "b", 0.6, 0.01, [(2000, 0.001), (8000, 0.008)])])
    with pytest.raises(ValueError, match="4 ranks"):
        LinkTable.from_calibrations([a, table_csv(tmp_path, "c", 0.5, 0.01, [(2000, 0.001), (8000, 0.008)], ranks=4)])
    with pytest.raises(ValueError, match="second both-ways table"):
        LinkTable.from_calibrations([a, table_csv(tmp_path, "d", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)])])
    with pytest.raises(ValueError, match="no both-ways"):
        LinkTable.from_calibrations([one])
    with pytest.raises(ValueError, match="no one-way .*a2a_one"):
        LinkTable.from_calibrations([a])
    with pytest.raises(ValueError, match="two sizes"):
        LinkTable.from_calibrations([table_csv(tmp_path, "f", 0.5, 0.0, [(2000, 0.001)])])
    with pytest.raises(ValueError, match="sidecar"):
        LinkTable.from_calibrations([str(tmp_path / "missing.csv")])
    side = json.loads((tmp_path / "a.json").read_text())
    del side["rows"][1]["mean_s"]  # a calibration that kept only the medians
    (tmp_path / "a.json").write_text(json.dumps(side))
    with pytest.raises(ValueError, match="a.csv: its sidecar JSON has no mean_s .* all_to_all of 8000 B"):
        LinkTable.from_calibrations([a, one])


def test_link_table_reads_all_reduce_calibrations(tmp_path):
    """All-reduce files (``--ops all_reduce``) are kept apart, keyed by the tensor's bytes; a run
    that needs them and a table without them is a one-line error; a file of both ops is refused."""
    both = table_csv(tmp_path, "both0", 0.5, 0.0, [(2000, 0.001), (8000, 0.008)])
    one = table_csv(tmp_path, "one0", 0.5, 0.0, [(2000, 0.0008), (8000, 0.004)], one_way=True)
    t = LinkTable.from_calibrations([
        both, one,
        table_csv(tmp_path, "ar0", 0.5, 0.0, [(1000, 0.002), (4000, 0.008)], op="all_reduce"),
        table_csv(tmp_path, "ar10", 0.5, 0.01, [(1000, 0.001), (4000, 0.004)], op="all_reduce"),
    ])
    assert t.gaps_s == (0.0,) and t.allreduce_gaps_s == (0.0, 0.01)
    assert t.seconds(1000, 1000, 0.0) == pytest.approx(0.001)  # the all-to-all curve is unchanged
    assert t.allreduce_seconds(1000, 0.0) == pytest.approx(0.002)
    assert t.allreduce_seconds(2000, 0.005) == pytest.approx(0.5 * (0.002 * 2 + 0.001 * 2))  # linear in log-log
    assert t.allreduce_seconds(0, 0.0) == 0.0
    with pytest.raises(ValueError, match="all_reduce calibrations"):
        LinkTable.from_calibrations([both, one]).allreduce_seconds(1000, 0.0)
    mixed = tmp_path / "mixed.csv"
    mixed.write_text("op,ranks,bytes,seconds\nall_to_all,2,2000,0.001\nall_reduce,2,2000,0.001\n"
                     "all_to_all,2,8000,0.004\n")
    (tmp_path / "mixed.json").write_text(json.dumps({"link": {"gbit": 0.5}, "gap_s": 0.0}))
    with pytest.raises(ValueError, match="not both"):
        LinkTable.from_calibrations([both, one, str(mixed)])
