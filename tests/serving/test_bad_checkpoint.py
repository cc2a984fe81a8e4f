"""A corrupt or crafted checkpoint given to the server is a one-line error before anything is
served (the restricted readers of ``checkpointing.safety``; issue 22); a corrupt or incomplete
newest checkpoint's error names the remedy, the complete checkpoint before it, by path."""

import json
import shutil

import pytest


def add_older(ckpt) -> str:
    """A complete copy of ``ckpt``'s only checkpoint, one iteration older, beside it; its path."""
    newest = next(p for p in ckpt.iterdir() if p.name.startswith("iter_"))
    iteration = int(newest.name[len("iter_"):]) - 1
    older = ckpt / f"iter_{iteration:07d}"
    shutil.copytree(newest, older)
    manifest = json.loads((older / "manifest.json").read_text())
    manifest["iteration"] = iteration
    (older / "manifest.json").write_text(json.dumps(manifest))
    return str(older)


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
            "import megatron.components.loading as loading\n"
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


def damage_newest_beside_an_older(src, ckpt, damage: str):
    """Copy checkpoint ``src`` to ``ckpt``, add a complete older one beside its checkpoint and damage
    the newest: ``truncated_shard`` (half of one shard) or ``no_manifest``. Returns (the older
    checkpoint's path, the text the error must contain)."""
    import os

    shutil.copytree(src, ckpt)
    newest = next(p for p in ckpt.iterdir() if p.name.startswith("iter_"))
    older = add_older(ckpt)
    if damage == "no_manifest":
        (newest / "manifest.json").unlink()
        return older, f"newest checkpoint {newest} is incomplete (no manifest.json)"
    shard = next(p for p in sorted(newest.iterdir()) if p.suffix == ".distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    return older, f"checkpoint {newest} is corrupt: {shard.name} has"


@pytest.mark.parametrize("damage", ["truncated_shard", "no_manifest"])
def test_a_bad_newest_checkpoint_names_the_older_one_to_load(damage, serve_ckpts, tmp_path):
    """The server has no --load-fallback: the remedy it names is ``--load DIR/iter_N`` of the
    complete checkpoint before the bad one."""
    from tools.spawn import run_distributed
    from tests.training.test_reliability import main_in_rank

    older, expect = damage_newest_beside_an_older(serve_ckpts["standard"], tmp_path / "ckpt", damage)
    argv = ["--load", str(tmp_path / "ckpt"), "--port", "0", "--ready-file", str(tmp_path / "ready.json")]
    code, _, err = run_distributed(main_in_rank, 1, "megatron.inference.serve", argv, timeout_s=240)[0]
    lines = [l for l in err.strip().splitlines() if l.startswith("megatron.inference.serve: error: ")]
    assert code == 2 and len(lines) == 1 and expect in lines[0], err
    assert f"load the one before it with --load {older}" in lines[0] and "--load-fallback" not in lines[0], lines[0]
