"""``python -m tools.semmoe export-costs``: a placement's rank-to-rank traffic beside the network's
cost matrix. The traffic adds up to ``evaluate``'s all-to-all bytes per token (rel 1e-12: the same
counts, summed in another order) and the document passes the ``moe-ep-cost/1`` checker."""

import json

import numpy as np
import pytest

from moe_variants.semmoe.methods import place
from moe_variants.semmoe.metrics import evaluate
from moe_variants.semmoe.profile import save_profile, split_profile
from moe_variants.semmoe.synthetic import SyntheticConfig, synthetic_profile
from moe_variants.semmoe.tables import save_tables
from netsim.cli import main as netsim_main
from netsim.ep_costs import read_cost_document
from tools.semmoe.cli import main

CFG = SyntheticConfig(num_requests=200, vocab_size=600, num_layers=2, num_experts=8, top_k=2, num_topics=4,
                      hidden_size=32)  # fmt: skip


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("costs")
    prof, held = split_profile(synthetic_profile(CFG, seed=0), 0.3, seed=0)
    save_profile(held, root / "held.npz")
    for method in ("affinity-eplb", "semmoe"):
        save_tables(place(method, prof, 4), root / method)
    assert netsim_main(["ep-costs", "--topology", "torus3d", "--num-xpus", "4", "--ep", "4",
                        "--out", str(root / "costs4.json")]) == 0  # fmt: skip
    assert netsim_main(["ep-costs", "--topology", "scale-up", "--num-xpus", "2", "--ep", "2",
                        "--out", str(root / "costs2.json")]) == 0  # fmt: skip
    return root, held


@pytest.mark.parametrize("method, mode", [("affinity-eplb", "dp"), ("semmoe", "tp")])
def test_traffic_adds_up_to_evaluate(inputs, tmp_path, capsys, method, mode):
    root, held = inputs
    out = tmp_path / "c.json"
    assert main(["export-costs", "--costs", str(root / "costs4.json"), "--tables", str(root / method),
                 "--profile", str(root / "held.npz"), "--mode", mode, "--out", str(out)]) == 0  # fmt: skip
    assert "ns of link time per token" in capsys.readouterr().out
    doc = read_cost_document(out)
    traffic, cost = np.array(doc["traffic"]), np.array(doc["cost"])
    e = evaluate(place(method, split_profile(synthetic_profile(CFG, seed=0), 0.3, seed=0)[0], 4), held, mode, 32)
    assert traffic.sum() == pytest.approx(e.a2a_bytes / held.num_tokens, rel=1e-12)
    all_bytes = 32 * 2 * CFG.top_k * CFG.num_layers  # every activation once, sent or kept
    assert traffic.sum() + sum(doc["local_bytes_per_token"]) == pytest.approx(all_bytes, rel=1e-12)
    source_expert = np.array(doc["source_expert"])  # [D, L, N], activations per token
    assert source_expert.shape == (4, CFG.num_layers, CFG.num_experts)
    assert source_expert.sum(axis=(0, 2)) == pytest.approx([CFG.top_k] * CFG.num_layers, rel=1e-12)
    assert doc["link_seconds_per_token"] == pytest.approx(float((traffic * cost).sum()), rel=1e-12)
    assert doc["traffic_source"]["placement"] == method and doc["traffic_source"]["mode"] == mode
    assert doc["traffic_source"]["scheduled"] == (method == "semmoe")


def test_costs_for_another_rank_count_is_one_line(inputs, tmp_path, capsys):
    root, _ = inputs
    rc = main(["export-costs", "--costs", str(root / "costs2.json"), "--tables", str(root / "semmoe"),
               "--profile", str(root / "held.npz"), "--out", str(tmp_path / "c.json")])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "is for 2 EP ranks" in err and err.count("\n") == 1
    assert not (tmp_path / "c.json").exists()
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "moe-ep-cost/1"}))
    rc = main(["export-costs", "--costs", str(tmp_path / "bad.json"), "--tables", str(root / "semmoe"),
               "--profile", str(root / "held.npz"), "--out", str(tmp_path / "c.json")])  # fmt: skip
    assert rc == 2 and "bad.json: missing key(s)" in capsys.readouterr().err
