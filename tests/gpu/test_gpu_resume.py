"""GPU tier: resuming with dropout is exact at TP=1, because the checkpoint holds megatron-core's
CUDA RNG tracker states (the CPU tests run the no-op inference tracker and cannot see this).

The tiny MoE is trained for 6 steps under torchrun on one GPU (NCCL, world size 1, megatron-core's
local spec) with attention dropout 0.1 and no other source of randomness (hidden dropout 0, no
router jitter; the data order follows the consumed samples), saving at step 3. A run resumed from
that checkpoint must give steps 4-6 the uninterrupted run's losses. Tolerance 1e-5 absolute: the
same kernels on the same inputs, but the MoE's scatter-adds may use atomics whose order can differ
between runs. A control resumed with ``--no-load-rng`` (the tracker re-seeded, so other dropout
masks) must differ by more than 1e-4, which shows the comparison can see a wrong RNG state.
Timings are not asserted. Skipped on machines without a CUDA GPU.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tests.helpers import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu()]

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny_moe_cpu.yaml"
ARGS = ["--config", TINY, "--expert-model-parallel-size", 1, "--tensor-model-parallel-size", 1,
        "--transformer-impl", "local", "--attention-dropout", 0.1, "--hidden-dropout", 0.0,
        "--train-iters", 6, "--lr-warmup-iters", 2, "--log-interval", 1, "--eval-interval", 6,
        "--eval-iters", 0, "--save-interval", 3]
EXACT = 1e-5
SENSITIVE = 1e-4


def _torchrun(module: str, args: list, nproc: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module,
           *[str(a) for a in args]]
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        return subprocess.CompletedProcess(cmd, 124, err.stdout or "", f"{err.stderr or ''}\ntimed out after {timeout}s")


def _train(save: pathlib.Path, *extra) -> dict:
    proc = _torchrun("megatron.training.pretrain_gpt", ARGS + ["--save", save, *extra])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    losses = {}
    for line in (save / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec:
            losses[rec["step"]] = rec["lm_loss"]
    return losses


def _resume(full: pathlib.Path, save: pathlib.Path, *extra) -> dict:
    save.mkdir()
    shutil.copytree(full / "iter_0000003", save / "iter_0000003")
    return _train(save, "--load", save, *extra)


def _tracker_names(checkpoint: pathlib.Path) -> list:
    """The CUDA RNG tracker streams in the checkpoint's RNG state (rank 0's)."""
    import torch

    from megatron.components.checkpointing.safety import read_metadata

    for index, info in read_metadata(str(checkpoint)).storage_data.items():
        if index.fqn.startswith("rng_state"):
            with open(checkpoint / info.relative_path, "rb") as f:
                f.seek(info.offset)
                obj = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
            obj = obj[0] if isinstance(obj, list) else obj
            return sorted(obj.get("cuda_tracker", {}))
    return []


def test_resume_with_dropout_is_exact_at_tp1(tmp_path, report):
    full = _train(tmp_path / "full")
    tracker = _tracker_names(tmp_path / "full" / "iter_0000003")
    resumed = _resume(tmp_path / "full", tmp_path / "resumed")
    control = _resume(tmp_path / "full", tmp_path / "control", "--no-load-rng")
    steps = [4, 5, 6]
    diff = max(abs(resumed[s] - full[s]) for s in steps)
    control_diff = max(abs(control[s] - full[s]) for s in steps)
    report["figures"] = {"losses": [full[s] for s in steps], "resumed_max_abs_diff": diff,
                         "no_load_rng_max_abs_diff": control_diff, "tracker_states": tracker}
    report["result"] = (f"TP=1, attention dropout 0.1: steps 4-6 resumed vs uninterrupted max |diff| {diff:.2e}; "
                        f"with --no-load-rng {control_diff:.2e}; tracker streams saved: {', '.join(tracker)}")
    assert "model-parallel-rng" in tracker
    assert diff <= EXACT, (full, resumed)
    assert control_diff > SENSITIVE, (full, control)
