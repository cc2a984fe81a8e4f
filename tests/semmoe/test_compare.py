"""``python -m tools.semmoe compare``: every run equals its own split, placement and ``evaluate``
(exact: the same arithmetic), the summary is each figure's median and range over the runs."""

import json

import numpy as np
import pytest

from moe_variants.semmoe.methods import place, with_schedule
from moe_variants.semmoe.metrics import evaluate
from moe_variants.semmoe.profile import save_profile, split_profile
from moe_variants.semmoe.synthetic import SyntheticConfig, synthetic_profile
from tools.semmoe.cli import main

CFG = SyntheticConfig(num_requests=300, vocab_size=800, num_layers=2, num_experts=16, top_k=2, num_topics=4,
                      zipf=0.5, hidden_size=64)  # fmt: skip


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("compare") / "all.npz"
    save_profile(synthetic_profile(CFG, seed=0), path)
    return path


def test_runs_summary_and_table(profile_path, tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["compare", "--profile", str(profile_path), "--ep", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "median [range of 3 runs]" in printed and "affinity-eplb+schedule" in printed
    res = json.loads(out.read_text())
    assert res["interval"] == "range of 3 runs" and res["seeds"] == [0, 1, 2]
    rows = {(r["placement"], r["mode"]): r for r in res["rows"]}
    placements = ["contiguous", "eplb", "affinity-eplb", "semmoe", "affinity-eplb+schedule"]
    assert set(rows) == {(p, m) for p in placements for m in ("dp", "tp")}
    assert rows[("semmoe", "tp")]["scheduling"] == "Algorithm 3"
    assert rows[("affinity-eplb", "dp")]["scheduling"] == "round-robin"
    for r in res["rows"]:
        assert [run["seed"] for run in r["runs"]] == [0, 1, 2]
        for key, s in r["summary"].items():
            values = [run[key] for run in r["runs"]]
            assert s == {"median": np.median(values), "min": min(values), "max": max(values)}
    # a run is its own split, placement and evaluation
    prof, held = split_profile(synthetic_profile(CFG, seed=0), 0.2, seed=1)
    for label, mode, tables in (
        ("contiguous", "dp", place("contiguous", prof, 4, seed=1)),
        ("semmoe", "tp", place("semmoe", prof, 4, seed=1)),
        ("affinity-eplb+schedule", "tp", with_schedule(place("affinity-eplb", prof, 4, seed=1), prof)),
    ):
        e = evaluate(tables, held, mode, 64)
        run = rows[(label, mode)]["runs"][1]
        assert run["lar"] == e.lar and run["bytes_per_token"] == e.a2a_bytes / held.num_tokens
        assert run["bytes_per_token_per_device"] == e.a2a_bytes_per_device / held.num_tokens
        assert run["peak_to_mean"] == e.peak_to_mean
    # the planted groups: co-located experts need fewer sends per token than EPLB's packing
    per_device = {p: rows[(p, "dp")]["summary"]["bytes_per_token_per_device"]["max"] for p in ("eplb", "affinity-eplb")}
    assert per_device["affinity-eplb"] < per_device["eplb"]


def test_given_heldout_varies_only_the_solver(profile_path, tmp_path):
    out = tmp_path / "c.json"
    assert main(["compare", "--profile", str(profile_path), "--heldout", str(profile_path), "--ep", "2",
                 "--methods", "contiguous,semmoe", "--scheduled", "", "--mode", "dp", "--seeds", "0,4",
                 "--out", str(out)]) == 0  # fmt: skip
    res = json.loads(out.read_text())
    assert res["fraction"] is None and len(res["rows"]) == 2
    contiguous = next(r for r in res["rows"] if r["placement"] == "contiguous")["summary"]["lar"]
    assert contiguous["min"] == contiguous["max"]  # no split, no randomness


@pytest.mark.parametrize("argv, message", [
    (["--methods", "contiguous,nope"], "--methods: unknown method(s) nope"),
    (["--seeds", "1,1"], "--seeds must name distinct seeds"),
    (["--scheduled", "semmoe"], "--scheduled semmoe: the method schedules tokens itself"),
    (["--ep", "3"], "--ep 3 must divide"),
])
def test_bad_input_is_one_line(profile_path, tmp_path, capsys, argv, message):
    args = ["compare", "--profile", str(profile_path), "--ep", "4", "--out", str(tmp_path / "c.json"), *argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "c.json").exists()
