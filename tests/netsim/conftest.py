"""Inputs of the replay's tests: link-table calibrations written as ``bench_ep.py --collectives``
writes them (a CSV of medians and a sidecar JSON with the link, the gap and each row's mean)."""

from __future__ import annotations

import json


def table_csv(tmp_path, name, gbit, gap_s, rows, one_way=False, ranks=2, op="all_to_all", medians=None):
    """A calibration CSV (``rows``: (input bytes, mean seconds)) with its sidecar JSON; the CSV's
    medians are ``medians`` where given, else the means."""
    medians = medians or [s for _, s in rows]
    path = tmp_path / f"{name}.csv"
    path.write_text("op,ranks,bytes,seconds\n" + "".join(f"{op},{ranks},{b},{m}\n" for (b, _), m in zip(rows, medians)))
    side = [{"op": op, "ranks": ranks, "bytes": b, "seconds": m, "mean_s": s} for (b, s), m in zip(rows, medians)]
    (tmp_path / f"{name}.json").write_text(json.dumps({"link": {"gbit": gbit}, "gap_s": gap_s, "one_way": one_way,
                                                       "rows": side}))
    return str(path)


def link_table(tmp_path, gbit=0.5):
    """Both ways after 0 and 10 ms of rest, one way after 0 ms: off-rank 1000 B and 4000 B."""
    from netsim.link_table import LinkTable

    return LinkTable.from_calibrations(link_table_paths(tmp_path, gbit))


def link_table_paths(tmp_path, gbit=0.5):
    return [
        table_csv(tmp_path, "both0", gbit, 0.0, [(2000, 0.001), (8000, 0.008)]),
        table_csv(tmp_path, "both10", gbit, 0.01, [(2000, 0.0005), (8000, 0.004)]),
        table_csv(tmp_path, "one0", gbit, 0.0, [(2000, 0.0008), (8000, 0.004)], one_way=True),
    ]


def flat_table(tmp_path, gbit=0.5):
    """A link whose calls cost ``max(1 ms, 1 us per off-rank byte)`` whatever the rest and the
    direction (both curves equal at every gap): a step's collectives can be added up by hand."""
    from netsim.link_table import LinkTable

    rows = [(2000, 0.001), (2_000_000, 1.0)]  # off-rank 1000 B and 1 MB on 2 ranks
    return LinkTable.from_calibrations([table_csv(tmp_path, "flat_both", gbit, 0.0, rows),
                                        table_csv(tmp_path, "flat_one", gbit, 0.0, rows, one_way=True)])
