"""Per-EP-rank costs (``netsim.ep_costs``) and the ``moe-ep-cost/1`` document: routes worked out by
hand per topology (costs compared with rel 1e-12: one division and a product), the checker's
rules one by one, a JSON round trip and the ``ep-costs`` command."""

import json
import subprocess
import sys

import numpy as np
import pytest

from netsim.cli import main
from netsim.collectives import DGX_H100_INTER, DGX_H100_INTRA, GB, Network
from netsim.ep_costs import (
    SCHEMA,
    check_cost_document,
    cost_document,
    rank_costs,
    read_cost_document,
    with_traffic,
    write_cost_document,
)


def test_switched_networks_by_hand():
    up = rank_costs(Network("scale-up", 8, 450 * GB), 4)
    off = ~np.eye(4, dtype=bool)
    assert up.hops.tolist() == (2 * off).astype(int).tolist()
    assert up.cost[off] == pytest.approx(2 / (450 * GB * DGX_H100_INTRA.utilization), rel=1e-12)
    assert np.all(np.diagonal(up.cost) == 0) and np.all(np.diagonal(up.latency) == 0)
    out = rank_costs(Network("scale-out", 8, 50 * GB, gpus_per_node=4, node_bandwidth=450 * GB), 8)
    assert out.cost[0, 3] == pytest.approx(2 / (450 * GB * DGX_H100_INTRA.utilization), rel=1e-12)  # same node
    assert out.cost[0, 4] == pytest.approx(2 / (50 * GB * DGX_H100_INTER.utilization), rel=1e-12)  # across
    assert out.latency[0, 4] == DGX_H100_INTER.alpha_dest and out.latency[0, 1] == DGX_H100_INTRA.alpha_dest
    np.testing.assert_array_equal(out.cost, out.cost.T)


def test_torus_and_full_mesh_routes_by_hand():
    # 16 ranks on a 4x2x2 torus: rank r = (r % 4, r // 4 % 2, r // 8); the 4-ring wraps
    torus = rank_costs(Network("torus3d", 16, 60 * GB, dims=(4, 2, 2)), 16)
    assert torus.hops[0].tolist() == [0, 1, 2, 1, 1, 2, 3, 2, 1, 2, 3, 2, 2, 3, 4, 3]
    link = 60 * GB / 6  # 6 ports per XPU (two per dimension)
    assert torus.cost[0, 14] == pytest.approx(4 / (link * DGX_H100_INTRA.utilization), rel=1e-12)
    # 4 ranks of an 8x2x2 torus: half of the first ring, a line (no wrap-around in the sub-block);
    # all of a 4x4x4 torus's first ring wraps
    assert rank_costs(Network("torus3d", 32, 60 * GB, dims=(8, 2, 2)), 4).hops[0].tolist() == [0, 1, 2, 3]
    assert rank_costs(Network("torus3d", 64, 60 * GB), 4).hops[0].tolist() == [0, 1, 2, 1]
    mesh = rank_costs(Network("fullmesh3d", 16, 60 * GB, dims=(4, 2, 2)), 16)
    assert mesh.hops[0].tolist() == [0, 1, 1, 1, 1, 2, 2, 2, 1, 2, 2, 2, 2, 3, 3, 3]
    with pytest.raises(ValueError, match="do not fit"):
        rank_costs(Network("scale-up", 4, GB), 8)


def _traffic_doc():
    doc = cost_document(Network("scale-out", 4, 50 * GB, gpus_per_node=2), 4)
    traffic = np.arange(16, dtype=float).reshape(4, 4)
    return with_traffic(doc, traffic, np.ones(4), np.full((4, 2, 3), 0.5), {"placement": "test"})


def test_document_round_trip(tmp_path):
    doc = _traffic_doc()
    assert doc["schema"] == SCHEMA and doc["num_ranks"] == 4 and doc["units"]["traffic"] == "bytes/token"
    assert np.diagonal(np.array(doc["traffic"])).tolist() == [0.0] * 4  # what stays local is not traffic
    traffic, cost = np.array(doc["traffic"]), np.array(doc["cost"])
    assert doc["link_seconds_per_token"] == pytest.approx(float((traffic * cost).sum()))
    path = write_cost_document(doc, tmp_path / "c.json")
    assert read_cost_document(path) == json.loads(json.dumps(doc))


def _broken(change):
    doc = json.loads(json.dumps(_traffic_doc()))
    change(doc)
    return doc


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("cost"), "missing key(s): cost"),
    (lambda d: d.update(schema="moe-ep-cost/2"), "schema: expected"),
    (lambda d: d.update(num_ranks=True), "num_ranks: expected a positive integer"),
    (lambda d: d.update(num_ranks=3), "cost: expected a 3 x 3 matrix"),
    (lambda d: d["cost"][0].pop(), "cost: not a matrix"),
    (lambda d: d["latency"][1].__setitem__(2, -1.0), "latency: entries must be finite and non-negative"),
    (lambda d: d["cost"][1].__setitem__(2, float("nan")), "cost: entries must be finite"),
    (lambda d: d["hops"][2].__setitem__(2, 1), "hops: the diagonal must be zero"),
    (lambda d: d["hops"][0].__setitem__(1, 1.5), "hops: entries must be integers"),
    (lambda d: d["traffic"][3].__setitem__(3, 5.0), "traffic: the diagonal must be zero"),
    (lambda d: d.pop("source_expert"), "traffic: keys source_expert are missing"),
    (lambda d: d.update(local_bytes_per_token=[1.0]), "local_bytes_per_token: expected 4"),
    (lambda d: d.update(source_expert=[[1.0]]), "source_expert: expected a [4][L][N]"),
    (lambda d: d.update(link_seconds_per_token=1.0), "link_seconds_per_token"),
])
def test_checker_rejects(change, message):
    with pytest.raises(ValueError) as e:
        check_cost_document(_broken(change))
    assert message in str(e.value)
    check_cost_document(_traffic_doc())  # the unbroken document passes


def test_read_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_cost_document(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json: not JSON"):
        read_cost_document(tmp_path / "bad.json")
    (tmp_path / "wrong.json").write_text(json.dumps({"schema": SCHEMA}))
    with pytest.raises(ValueError, match="wrong.json: missing key"):
        read_cost_document(tmp_path / "wrong.json")


def test_ep_costs_command_without_torch(tmp_path):
    out = tmp_path / "c.json"
    code = (f"import sys, netsim.cli; rc = netsim.cli.main(['ep-costs', '--topology', 'scale-out', '--num-xpus', '16', "
            f"'--ep', '16', '--gpus-per-node', '4', '--bandwidth-gbps', '50', '--out', {str(out)!r}]); "
            "assert rc == 0 and 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    doc = read_cost_document(out)
    assert doc["num_ranks"] == 16 and doc["network"]["gpus_per_node"] == 4 and "traffic" not in doc
    cost = np.array(doc["cost"])
    assert cost[0, 3] < cost[0, 4]  # another node costs more


def test_ep_costs_command_errors(tmp_path, capsys):
    assert main(["ep-costs", "--topology", "scale-up", "--num-xpus", "4", "--ep", "8",
                 "--out", str(tmp_path / "c")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "8 EP ranks do not fit a network of 4 XPUs" in err and err.count("\n") == 1
    assert main(["ep-costs", "--topology", "scale-out", "--num-xpus", "12", "--ep", "4", "--out",
                 str(tmp_path / "c")]) == 2  # fmt: skip
    assert "not a multiple of gpus_per_node" in capsys.readouterr().err
