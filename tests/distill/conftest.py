"""A tiny pretrained teacher shared by the distillation tests (4 steps, EP=2), and one FCSD run of it
on 2 ranks of one torchrun (``student``)."""

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


def fcsd_args(teacher_ckpt, out) -> list:
    """The flags of the ``student`` run: 4 FCSD steps at EP=2 from the teacher, into ``out``."""
    return ["--load", teacher_ckpt / "teacher", "--farskip", "all", "--farskip-impl", "overlapped",
            "--expert-model-parallel-size", 2, "--save", out, "--train-iters", 4, "--eval-interval", 2,
            "--eval-iters", 0, "--log-interval", 1, "--micro-batch-size", 4, "--global-batch-size", 16,
            "--proxy-max-windows", 8, "--patience", 5, "--data-cache-path", teacher_ckpt / "cache", "--lr", 1e-3]


def teacher_digest(teacher_ckpt) -> str:
    """sha256 of the teacher checkpoint's tensor files."""
    import hashlib
    import os

    teacher = teacher_ckpt / "teacher" / "iter_0000004"
    return hashlib.sha256(b"".join(open(os.path.join(teacher, f), "rb").read()
                                   for f in sorted(os.listdir(teacher)) if f.endswith(".distcp"))).hexdigest()


@pytest.fixture(scope="session")
def student(teacher_ckpt):
    """FCSD of the teacher (``fcsd_args``) on 2 ranks of one torchrun: the output directory, the
    finished process and the teacher's digest before the run."""
    from tests.helpers import torchrun

    before = teacher_digest(teacher_ckpt)
    out = teacher_ckpt / "student"
    proc = torchrun("distill.fcsd", fcsd_args(teacher_ckpt, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc, before
