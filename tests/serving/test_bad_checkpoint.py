"""A corrupt or crafted checkpoint given to the server is a one-line error before anything is
served (the restricted readers of ``checkpointing.safety``; issue 22)."""

import pytest


@pytest.mark.parametrize("damage", ["truncated_shard", "crafted_metadata"])
def test_bad_checkpoint_is_one_line(damage, serve_ckpts, tmp_path):
    from tools.spawn import run_distributed
    from tests.training.test_reliability import damaged_copy, main_in_rank

    ckpt = tmp_path / "ckpt"
    expect = damaged_copy(serve_ckpts["standard"], ckpt, damage, tmp_path / "PWNED")
    argv = ["--load", str(ckpt), "--port", "0", "--ready-file", str(tmp_path / "ready.json")]
    code, _, err = run_distributed(main_in_rank, 1, "megatron.inference.serve", argv, timeout_s=240)[0]
    lines = [l for l in err.strip().splitlines() if l.startswith("megatron.inference.serve: error: ")]
    assert code == 2 and len(lines) == 1 and expect in lines[0] and "Traceback" not in err, err
    assert not (tmp_path / "ready.json").exists() and not (tmp_path / "PWNED").exists()
