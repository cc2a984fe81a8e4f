"""A tiny pretrained teacher shared by the distillation tests (4 steps, EP=2)."""

import pytest


@pytest.fixture(scope="session")
def teacher_ckpt(tmp_path_factory):
    from tests.helpers import SMALL_PRETRAIN_ARGS, torchrun

    root = tmp_path_factory.mktemp("fcsd")
    proc = torchrun("megatron.training.pretrain_gpt", SMALL_PRETRAIN_ARGS + [
        "--train-iters", 4, "--expert-model-parallel-size", 2, "--save", root / "teacher",
        "--data-cache-path", root / "cache"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root
