"""tools/bench/deepspeed_modes.py: its summary of hand-made bench JSONs (exact) and its one-line errors."""

import json

import pytest

from tools.bench import deepspeed_modes


def _bench(path, steps_ms, losses, kept):
    """A bench_ep JSON with the fields the summary reads: per stack its median step, bytes, rows
    (400 routed; ``kept`` kept; DeepSpeed's 500 buffer rows) and rank 0's loss curve."""
    variants, per_rank, load = {}, {}, {}
    for stack, ms, loss in zip(deepspeed_modes.STACKS, steps_ms, losses):
        rows = {"routed": 400, "kept": kept}
        if stack == "deepspeed-moe":
            rows["buffer"] = 500
        variants[stack] = {"step_time_s": {"median": ms / 1e3}, "a2a_bytes": {"median": 2**20}, "dispatch_rows": rows}
        per_rank[stack] = [[{"rank": 0, "extra": {"lm_loss": [9.0] * 3 + [loss] * 5}}]]
        load[stack] = {"loaded": False}
    with open(path, "w") as f:
        json.dump({"variants": variants, "per_rank": per_rank, "runs": [{"load": load}]}, f)
    return str(path)


def test_summary_pairs_the_loss_by_seed_with_dropless_standard(tmp_path):
    paths = {"dropless": [_bench(tmp_path / "a.json", (100, 130), (5.0, 5.01), 400),
                          _bench(tmp_path / "b.json", (110, 120), (6.0, 6.02), 400)],
             "cf1.0": [_bench(tmp_path / "c.json", (90, 95), (5.03, 5.02), 340),
                       _bench(tmp_path / "d.json", (92, 91), (6.01, 6.00), 360)]}
    s = deepspeed_modes.summarize(paths)
    std, ds = s["cf1.0"]["standard"], s["cf1.0"]["deepspeed-moe"]
    assert std["step_ms"]["values"] == [90.0, 92.0] and std["step_ms"]["median"] == pytest.approx(91.0)
    assert std["dropped_fraction"] == pytest.approx(1 - 700 / 800) and std["padding_factor"] is None
    assert ds["padding_factor"] == pytest.approx(1000 / 800)
    assert std["loss_vs_dropless_standard"]["values"] == pytest.approx([0.03, 0.01])
    assert ds["loss_vs_dropless_standard"]["values"] == pytest.approx([0.02, 0.0])
    assert s["dropless"]["standard"]["loss_vs_dropless_standard"]["values"] == [0.0, 0.0]
    assert "+0.0300 +0.0100" in deepspeed_modes.table(s)


@pytest.mark.parametrize("argv, message", [(["--modes", "abc"], "--modes/--seeds"), (["--modes", "0"], "--modes"),
                                           (["--seeds", "x"], "--modes/--seeds")])
def test_bad_modes_and_seeds_are_one_line_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        deepspeed_modes.main(["--out", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert ("deepspeed_modes.py: error: " + message) in err
