"""The one-node pretraining run that several test modules compare against (``run_a``)."""

import pytest

from tests.helpers import SMALL_PRETRAIN_ARGS, torchrun

MODULE = "megatron.training.pretrain_gpt"
RUN_A_ARGS = SMALL_PRETRAIN_ARGS + ["--train-iters", 6, "--expert-model-parallel-size", 2, "--save-interval", 3]


@pytest.fixture(scope="session")
def run_a(tmp_path_factory):
    """6 steps at EP=2 on 2 ranks of one torchrun (``RUN_A_ARGS``) with checkpoints at 3 and 6: the
    root directory (its ``cache`` is the data cache), the save directory and the finished process."""
    root = tmp_path_factory.mktemp("pretrain")
    save = root / "a"
    proc = torchrun(MODULE, RUN_A_ARGS + ["--save", save, "--data-cache-path", root / "cache"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, save, proc
