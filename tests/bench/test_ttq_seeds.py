"""tools/bench/ttq_seeds.py's figures and intervals on hand-made ttq.json summaries (exact)."""

import pytest

from tools.bench import ttq_seeds


def _ttq(std_ppls, var_ppls, speedup, var_step=0.8):
    def variant(ppls, step_s, speedup_to_target):
        return {"evaluations": [{"step": 50 * (i + 1), "clock_s": 10.0 * (i + 1), "ppl": p} for i, p in enumerate(ppls)],
                "best_ppl": min(ppls), "done": True, "speedup_to_target": speedup_to_target,
                "speedup_per_step": 1.0 / step_s, "mean_step_s": step_s, "a2a_share_median": 0.4 * step_s}

    return {"variants": {"standard": variant(std_ppls, 1.0, 1.0), "farskip": variant(var_ppls, var_step, speedup)}}


def test_final_perplexity_is_paired_by_seed_and_the_target_may_be_missed():
    per_seed = {
        1: ttq_seeds.seed_figures(_ttq([300, 200], [310, 210], None)),  # final 210 / 200 = 1.05, no target
        2: ttq_seeds.seed_figures(_ttq([300, 250], [290, 240], 1.5)),  # 0.96
        3: ttq_seeds.seed_figures(_ttq([300, 220], [280, 230], 1.1, var_step=0.5)),  # last 230 / 220, best 230
    }
    assert per_seed[1]["farskip"]["final_ppl_vs_standard"] == pytest.approx(1.05)
    assert per_seed[3]["farskip"]["best_ppl"] == 230 and per_seed[3]["farskip"]["final_ppl"] == 230
    s = ttq_seeds.summarize(per_seed)["farskip"]
    assert s["seeds"] == 3 and s["reached_target"] == 2
    assert s["final_ppl"]["median"] == 230 and s["final_ppl"]["values"] == [210, 240, 230]
    assert s["final_ppl_vs_standard"]["median"] == pytest.approx(230 / 220)
    assert s["speedup_to_target"]["n"] == 2 and s["speedup_to_target"]["median"] == pytest.approx(1.3)
    assert s["speedup_per_step"]["median"] == pytest.approx(1.25)
    # the interval brackets the median and lies inside the values' range
    ci = s["final_ppl_vs_standard"]
    assert 0.96 <= ci["ci_low"] <= ci["median"] <= ci["ci_high"] <= 1.05
    assert "2/3" in ttq_seeds.table(ttq_seeds.summarize(per_seed))


def test_reserved_flags_and_a_missing_standard_are_refused(capsys):
    with pytest.raises(SystemExit):
        ttq_seeds.main(["--out", "x", "--", "--seed", "5"])
    assert "--seed is set by ttq_seeds.py" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ttq_seeds.main(["--out", "x", "--variants", "bigmac,farskip"])
    assert "must start with standard" in capsys.readouterr().err


def test_bad_seeds_are_a_one_line_error(capsys):
    with pytest.raises(SystemExit):
        ttq_seeds.main(["--out", "x", "--seeds", "a,b"])
    assert "--seeds: comma-separated integers" in capsys.readouterr().err
