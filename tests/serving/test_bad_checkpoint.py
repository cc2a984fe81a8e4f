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


def test_a_value_error_while_the_model_loads_keeps_its_traceback(serve_ckpts, tmp_path):
    """A ``ValueError`` raised inside the model load is a bug (a shape mismatch from torch or
    megatron-core), not bad input: the server exits 1 with its traceback, not a one-line ``error:``."""
    import os
    import subprocess
    import sys

    from tests.serving.conftest import REPO

    argv = ["--load", serve_ckpts["standard"], "--port", "0", "--ready-file", str(tmp_path / "ready.json")]
    code = ("import sys\n"
            "import megatron.training.loading as loading\n"
            "def load_model(*args, **kwargs):\n"
            "    raise ValueError('shape mismatch deep inside the model')\n"
            "loading.load_model = load_model\n"
            "from megatron.inference.serve import main\n"
            f"sys.exit(main({argv!r}))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback (most recent call last)" in proc.stderr and "error:" not in proc.stderr, proc.stderr[-3000:]
    # torch prefixes each traceback line of an initialised rank with "[rank0]: "
    assert proc.stderr.strip().splitlines()[-1].endswith("ValueError: shape mismatch deep inside the model")
    assert not (tmp_path / "ready.json").exists()
