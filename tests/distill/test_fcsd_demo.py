"""scripts/fcsd_demo.sh refuses bad settings at once (before an hour of teacher training), with a
one-line error, and writes nothing."""

import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("env, needle", [
    ({"DATASETS": "pretrain bogus"}, "unknown distillation corpus 'bogus'"),
    ({"STEPS": "abc"}, "STEPS must be a positive integer"),
])
def test_bad_settings_fail_fast(tmp_path, env, needle):
    runs = tmp_path / "runs"
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "fcsd_demo.sh"), str(tmp_path / "no_shared"), str(runs)],
                          cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert needle in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert not runs.exists()
