"""Every shipped example config parses, validates against a parallel layout it fits, and builds.

A typo in a key, an inconsistent parallel layout or a model megatron-core cannot build is caught
here, not on a user's cluster. Each example's model is built at TP=EP=PP=1 on the meta device (no
memory, no initialisation) with the local spec (Transformer Engine is GPU-only). The two real
model configs are checked against the published parameter counts with their real vocabularies
(DeepSeek-V2-Lite 15.7B, Qwen3-30B-A3B 30.5B; within 1%: the counts are rounded).
"""

import glob
import math
import os

import pytest

from tools.spawn import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = sorted(glob.glob(os.path.join(REPO, "examples", "*.yaml")))
# published totals and the tokenizers' vocabularies of the real model configs
PUBLISHED = {"deepseek_v2_lite.yaml": (15.7e9, 102400), "qwen3_30b_a3b.yaml": (30.5e9, 151936)}


def _configs(path):
    from megatron.components.arguments import parse_configs

    extra = {}
    if os.path.basename(path).startswith("fcsd_"):
        from distill.fcsd import FCSDConfig

        extra = {"fcsd": FCSDConfig}
    return parse_configs(["--config", path], prog="example", extra_sections=extra)


def _smallest_world(parallel) -> int:
    """The fewest ranks the example's layout runs on (data parallelism fills the rest)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    ep = parallel.expert_model_parallel_size * parallel.expert_tensor_parallel_size
    return pp * math.lcm(tp, ep)


def test_there_are_examples():
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_validates(path):
    from moe_variants.config import validate
    from moe_variants.farskip.config import FarSkipConfig

    configs = _configs(path)
    world = _smallest_world(configs.parallel)
    try:
        validate(configs.model, configs.parallel, world)
    except ValueError as err:
        if "needs NCCL" not in str(err):  # expert-TP with EP needs NCCL's uneven all-gather
            raise
    if configs.extra:
        assert not FarSkipConfig.of(configs.model).farskip.empty and configs.extra["fcsd"].patience >= 1


def _build_all(rank, world):
    import dataclasses

    import torch

    from megatron.components.parallel import initialize_parallel
    from moe_variants.builder import build_model
    from moe_variants.config import ParallelConfig, TransformerImpl

    pgc = initialize_parallel(ParallelConfig(), seed=1)
    counts = {}
    for path in EXAMPLES:
        name = os.path.basename(path)
        model_cfg = dataclasses.replace(_configs(path).model, transformer_impl=TransformerImpl.local)
        vocab = PUBLISHED.get(name, (None, 1024))[1]
        with torch.device("meta"):
            model = build_model(model_cfg, ParallelConfig(), vocab_size=vocab, pg_collection=pgc)
        assert {p.device.type for p in model.parameters()} == {"meta"}
        counts[name] = sum(p.numel() for p in model.parameters())
        del model
    return counts


def test_every_example_builds_on_the_meta_device():
    counts = run_distributed(_build_all, 1, timeout_s=300)[0]
    assert set(counts) == {os.path.basename(p) for p in EXAMPLES}
    for name, (published, _) in PUBLISHED.items():
        assert abs(counts[name] - published) / published < 0.01, (name, counts[name])


def _train_in(rank, world, cwd, argv):
    """``pretrain_gpt.main(argv)`` in a forked rank whose working directory is ``cwd``."""
    from tests.training.test_reliability import main_in_rank

    os.chdir(cwd)
    return main_in_rank(rank, world, "megatron.training.pretrain_gpt", argv)


def test_tiny_default_names_no_save_dir_so_variant_runs_need_no_save(tmp_path):
    """``examples/tiny_moe_cpu.yaml`` names no save directory: a plain run and a variant run on it,
    one after the other in the same working directory and without ``--save``, both train and write
    nothing there (a save directory in the YAML had the second refused as another run's
    checkpoints). ``make demo`` names the directory itself, the same for ``--save`` and ``--load``."""
    from tests.helpers import SMALL_PRETRAIN_ARGS

    tiny = os.path.join(REPO, "examples", "tiny_moe_cpu.yaml")
    checkpoint = _configs(tiny).checkpoint
    assert checkpoint.save is None and checkpoint.save_interval is None
    base = ["--config", tiny, *map(str, SMALL_PRETRAIN_ARGS), "--expert-model-parallel-size", "1",
            "--train-iters", "1", "--eval-iters", "0", "--data-cache-path", str(tmp_path / "cache")]
    work = tmp_path / "work"
    work.mkdir()
    for variant in ([], ["--farskip", "all"]):
        code, out, err = run_distributed(_train_in, 1, str(work), base + variant, timeout_s=240)[0]
        assert code == 0, err
    assert os.listdir(work) == []

    with open(os.path.join(REPO, "Makefile")) as f:
        demo = f.read().split("\ndemo:", 1)[1].split("\n\n", 1)[0].split()
    assert demo[demo.index("--save") + 1] == demo[demo.index("--load") + 1] == "runs/tiny_moe_cpu"
