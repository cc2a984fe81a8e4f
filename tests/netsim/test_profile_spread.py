"""``python -m tools.profile.profile_spread``: the spread of each fitted cost over profiles, the goal
verdict (``per_request_s`` not judged), and bad input in one line."""

import json
import subprocess
import sys

import pytest

from tests.serving.conftest import REPO
from tools.profile.profile_spread import SCHEMA, spread


def _profile(fixed, per_token=80e-6, per_request=0.0, dummy=0.017, iteration=0.002):
    costs = {"fixed_s": fixed, "per_token_s": per_token, "per_request_s": per_request, "dummy_s": dummy,
             "iteration_s": iteration}
    return {"schema": "serving-compute-profile/1", "variants": {"standard": costs, "bigmac": costs}}


def test_spread_is_max_over_min_and_judged_against_the_goal():
    result = spread([_profile(0.020), _profile(0.021), _profile(0.0205)], 0.05)
    assert result["schema"] == SCHEMA and result["profiles"] == 3
    fixed = result["variants"]["standard"]["fixed_s"]
    assert fixed["spread"] == pytest.approx(0.05) and fixed["median"] == pytest.approx(0.0205)
    assert fixed["half_widths"] is None  # these profiles state no interval of their own
    assert spread([_profile(0.020), _profile(0.0209)], 0.05)["within_goal"] is True
    assert spread([_profile(0.020), _profile(0.030)], 0.05)["within_goal"] is False
    # a per-request cost fitted as 0 in one profile is reported, not judged
    loose = spread([_profile(0.020, per_request=0.0), _profile(0.020, per_request=1e-4)], 0.05)
    assert loose["variants"]["standard"]["per_request_s"]["spread"] is None and loose["within_goal"] is True


def test_bad_input_is_one_line(tmp_path):
    good = tmp_path / "a.json"
    good.write_text(json.dumps(_profile(0.02)))
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"schema": "bench_serve/1"}))
    for args, words in (([str(good)], "at least 2 profiles"), ([str(good), str(bad)], "not a serving_compute profile"),
                        ([str(good), str(tmp_path / "missing.json")], "missing.json")):
        proc = subprocess.run([sys.executable, "-m", "tools.profile.profile_spread", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert words in proc.stderr
