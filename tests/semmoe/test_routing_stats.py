"""Routing statistics (the paper's Table 1 and the domain-expert mutual information) on
hand-made profiles; exact values computed by hand."""

import numpy as np
import pytest

from moe_variants.semmoe.profile import profile_from_arrays
from moe_variants.semmoe.routing_stats import activation_concentration, domain_expert_information, expert_counts


def _profile():
    # token 7 always routes to experts {0, 1}; token 9 alternates {0, 1} / {2, 3}; token 5 once
    token_ids = np.array([7, 9, 7, 9, 7, 9, 7, 9, 5], dtype=np.int32)
    routes = np.array([[[0, 1], [0, 1], [1, 0], [2, 3], [0, 1], [0, 1], [1, 0], [3, 2], [3, 1]]], dtype=np.uint8)
    offsets = np.array([0, 4, 9], dtype=np.int64)
    return profile_from_arrays(token_ids, offsets, routes, 16, 4, {})


def test_activation_concentration_by_hand():
    out = activation_concentration(_profile(), 0, min_count=2)
    assert out["tokens"] == 2  # token 5 is seen once
    # token 7: F1 1 at each of its 4 occurrences, top-2 share 1, other experts 0; token 9: hottest
    # {0, 1} (4 of 8 activations), F1 1, 0, 1, 0, the largest other expert 2 of 8. F1 quantiles are
    # over the 8 occurrences [0, 0, 1, 1, 1, 1, 1, 1]
    assert out["f1"]["p25"] == pytest.approx(0.75) and out["f1"]["p50"] == 1.0
    assert out["cum_hotness_topk"]["p50"] == pytest.approx(0.75)
    assert out["max_hotness_rest"]["p50"] == pytest.approx(0.125)
    assert activation_concentration(_profile(), 0, min_count=5)["tokens"] == 0


def test_expert_counts_and_domain_information():
    counts = expert_counts(_profile(), np.array([1]))
    assert counts.tolist() == [[3, 4, 1, 2]]  # the second request's 5 tokens x top-2
    assert domain_expert_information(np.array([[10, 0], [0, 10]]))["mutual_information_bits"] == pytest.approx(1.0)
    same = domain_expert_information(np.array([[5, 5], [10, 10]]))
    assert same["mutual_information_bits"] == pytest.approx(0.0, abs=1e-12)
    half = domain_expert_information(np.array([[3, 1], [1, 3]]))
    h = -(0.75 * np.log2(0.75) + 0.25 * np.log2(0.25))  # I = H(expert) - H(expert | domain) = 1 - h
    assert half["mutual_information_bits"] == pytest.approx(1 - h) and half["normalised"] == pytest.approx(1 - h)


def test_stats_command(tmp_path, capsys):
    import json

    from moe_variants.semmoe.profile import save_profile
    from tools.semmoe.cli import main

    prof = _profile()
    prof.meta["request_ids"] = ["a:x:0", "a:y:1"]
    save_profile(prof, tmp_path / "p.npz")
    out = tmp_path / "stats.json"
    assert main(["stats", "--profile", f"one={tmp_path / 'p.npz'}", "--profile", f"two={tmp_path / 'p.npz'}",
                 "--min-count", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["table1"]["one"][0]["tokens"] == 2
    same = result["information"]["profiles"]["per_layer"][0]  # two copies of one profile: no information
    assert same["mutual_information_bits"] == pytest.approx(0.0, abs=1e-12) and same["domain_entropy_bits"] == 1.0
    assert main(["stats", "--profile", f"one={tmp_path / 'p.npz'}", "--profile", f"one={tmp_path / 'p.npz'}"]) == 2
    assert "given twice" in capsys.readouterr().err
