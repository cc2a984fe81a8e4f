"""A corrupt or crafted checkpoint given to the server is a one-line error before anything is
served (the restricted readers of ``checkpoint_safety``; issue 22)."""

import os
import shutil

import pytest


@pytest.mark.parametrize("damage", ["truncated_shard", "crafted_metadata"])
def test_bad_checkpoint_is_one_line(damage, serve_ckpts, tmp_path, capsys):
    from megatron.inference.serve import main
    from tests.training.test_reliability import _craft_metadata

    ckpt = tmp_path / "ckpt"
    shutil.copytree(serve_ckpts["standard"], ckpt)
    it = next(p for p in ckpt.iterdir() if p.name.startswith("iter_"))
    if damage == "truncated_shard":
        shard = next(p for p in sorted(it.iterdir()) if p.suffix == ".distcp")
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
        expect = f"is corrupt: {shard.name} has"
    else:
        _craft_metadata(str(it), tmp_path / "PWNED")
        expect = "unsafe checkpoint"
    code = main(["--load", str(ckpt), "--port", "0", "--ready-file", str(tmp_path / "ready.json")])
    err = capsys.readouterr().err
    lines = [l for l in err.strip().splitlines() if l.startswith("megatron.inference.serve: error: ")]
    assert code == 2 and len(lines) == 1 and expect in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "ready.json").exists() and not (tmp_path / "PWNED").exists()
