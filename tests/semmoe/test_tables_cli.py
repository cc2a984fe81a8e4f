"""Table files and the ``python -m tools.semmoe`` commands (run in-process; exact checks)."""

import json

import numpy as np
import pytest

from tools.semmoe.cli import COMMANDS, main
from moe_variants.semmoe.methods import place
from moe_variants.semmoe.profile import save_profile, split_profile
from moe_variants.semmoe.synthetic import SyntheticConfig, synthetic_profile
from moe_variants.semmoe.tables import EXPERT_MAP_FILE, TABLES_FILE, Tables, load_tables, save_tables

CFG = SyntheticConfig(num_requests=200, vocab_size=500, num_layers=3, num_experts=8, top_k=2, num_topics=4)


def test_tables_roundtrip_and_expert_map(tmp_path):
    prof = synthetic_profile(CFG, seed=0)
    t = place("semmoe", prof, 4)
    save_tables(t, tmp_path / "tab")
    assert sorted(p.name for p in (tmp_path / "tab").iterdir()) == [EXPERT_MAP_FILE, TABLES_FILE]
    u = load_tables(tmp_path / "tab")
    assert (u.method, u.num_devices, u.lookback) == ("semmoe", 4, 2)
    for name in ("expert2device", "token2device", "token2device_conf", "seq2device", "seq2device_conf"):
        np.testing.assert_array_equal(getattr(u, name), getattr(t, name))
    emap = json.loads((tmp_path / "tab" / EXPERT_MAP_FILE).read_text())
    assert list(emap) == ["physical_to_logical_map"]  # SGLang's init_by_mapping takes exactly this key
    phy2log = np.array(emap["physical_to_logical_map"])
    per_rank = CFG.num_experts // 4
    for l in range(CFG.num_layers):
        assert sorted(phy2log[l].tolist()) == list(range(CFG.num_experts))
        ranks = np.arange(CFG.num_experts) // per_rank  # rank of each physical slot
        np.testing.assert_array_equal(t.expert2device[l][phy2log[l]], ranks)


def test_tables_validation_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match="same number of experts"):
        save_tables(Tables("x", 2, np.array([[0, 0, 0, 1]])), tmp_path / "t")
    with pytest.raises(ValueError, match="no such semmoe-tables file"):
        load_tables(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / TABLES_FILE).write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="not an npz archive"):
        load_tables(tmp_path / "bad")


def test_cli_solve_and_evaluate(tmp_path, capsys):
    prof, held = split_profile(synthetic_profile(CFG, seed=1), 0.3, seed=0)
    save_profile(prof, tmp_path / "prof.npz")
    save_profile(held, tmp_path / "held.npz")
    for method in ("contiguous", "eplb", "semmoe"):
        rc = main(["solve", "--profile", str(tmp_path / "prof.npz"), "--ep", "4", "--method", method,
                   "--seed", "3", "--out", str(tmp_path / method)])  # fmt: skip
        assert rc == 0
    out_json = tmp_path / "eval.json"
    rc = main(["evaluate", "--tables", *(str(tmp_path / m) for m in ("contiguous", "eplb", "semmoe")),
               "--profile", str(tmp_path / "held.npz"), "--mode", "tp", "--out", str(out_json)])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "semmoe" in printed and "LAR" in printed
    res = json.loads(out_json.read_text())
    assert [r["method"] for r in res["results"]] == ["contiguous", "eplb", "semmoe"]
    assert all(r["mode"] == "tp" for r in res["results"])
    by = {r["method"]: r for r in res["results"]}
    assert by["semmoe"]["lar"] > by["contiguous"]["lar"]
    assert load_tables(tmp_path / "semmoe").meta["seed"] == 3


def test_cli_evaluate_by_domain(tmp_path, capsys):
    prof, held = split_profile(synthetic_profile(CFG, seed=1), 0.3, seed=0)
    save_profile(prof, tmp_path / "prof.npz")
    assert main(["solve", "--profile", str(tmp_path / "prof.npz"), "--ep", "4", "--out", str(tmp_path / "t")]) == 0
    save_profile(held, tmp_path / "noids.npz")
    rc = main(["evaluate", "--tables", str(tmp_path / "t"), "--profile", str(tmp_path / "noids.npz"), "--split-ids", "1"])
    assert rc == 2 and "records no request ids" in capsys.readouterr().err
    n = held.num_requests
    held.meta["request_ids"] = [f"{'code' if i % 3 == 0 else 'chat'}:{i}" for i in range(n)]
    save_profile(held, tmp_path / "held.npz")
    rc = main(["evaluate", "--tables", str(tmp_path / "t"), "--profile", str(tmp_path / "held.npz"),
               "--split-ids", "1", "--out", str(tmp_path / "e.json")])  # fmt: skip
    assert rc == 0 and "per domain" in capsys.readouterr().out
    for r in json.loads((tmp_path / "e.json").read_text())["results"]:
        g = r["by_group"]
        assert set(g) == {"chat", "code"} and g["code"]["requests"] == len(range(0, n, 3))
        # the domains partition the activations: their token-weighted LAR is the whole profile's
        weighted = sum(d["lar"] * d["tokens"] for d in g.values()) / sum(d["tokens"] for d in g.values())
        assert weighted == pytest.approx(r["lar"])


def test_cli_errors_are_one_line(tmp_path, capsys):
    rc = main(["solve", "--profile", str(tmp_path / "nope.npz"), "--ep", "2", "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("python -m tools.semmoe: error: ") and err.count("\n") == 1
    save_profile(synthetic_profile(CFG, seed=0), tmp_path / "p.npz")
    rc = main(["solve", "--profile", str(tmp_path / "p.npz"), "--ep", "3", "--out", str(tmp_path / "t")])
    assert rc == 2 and "--expert-model-parallel-size 3" in capsys.readouterr().err


def test_commands_are_registered():
    assert {"solve", "evaluate", "compare", "export-costs", "synth", "split"} <= set(COMMANDS.commands)


def test_table_commands_start_without_torch(tmp_path):
    """synth, split, solve and export-costs are numpy and scipy: a fresh interpreter runs them
    without importing torch (about 2 s less per command); a model command's corrupt checkpoint is
    still a one-line error (its class is looked up once the checkpoint code is imported)."""
    import subprocess
    import sys

    code = f"""
import sys
from tools.semmoe.cli import main
G = {str(tmp_path)!r}
assert main(["synth", "--out", G + "/all.npz", "--num-requests", "40", "--seed", "0"]) == 0
assert main(["split", "--profile", G + "/all.npz", "--fraction", "0.25", "--out", G + "/p.npz", "--heldout", G + "/h.npz"]) == 0
assert main(["solve", "--profile", G + "/p.npz", "--ep", "2", "--method", "semmoe", "--out", G + "/t"]) == 0
print("torch" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "False"


def test_a_corrupt_checkpoint_in_a_model_command_is_one_line(tmp_path, capsys, monkeypatch):
    import dataclasses

    from megatron.components.checkpointing import CheckpointError

    def corrupt(args):
        raise CheckpointError("--load x: iter_0000004 is corrupt (a shard's sha256 differs)")

    monkeypatch.setitem(COMMANDS.commands, "profile", dataclasses.replace(COMMANDS.commands["profile"], run=corrupt))
    rc = main(["profile", "--load", str(tmp_path), "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "o.npz")])
    err = capsys.readouterr().err
    assert rc == 2 and err == "python -m tools.semmoe: error: --load x: iter_0000004 is corrupt (a shard's sha256 differs)\n"
