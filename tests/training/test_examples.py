"""Every shipped example config parses and validates (a typo in a key or an inconsistent parallel
layout is caught here, not on a user's cluster)."""

import glob
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = sorted(glob.glob(os.path.join(REPO, "examples", "*.yaml")))


def test_there_are_examples():
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_parses(path):
    from megatron.training.arguments import parse_configs

    extra = {}
    if os.path.basename(path).startswith("fcsd_"):
        from distill.fcsd import FCSDConfig

        extra = {"fcsd": FCSDConfig}
    configs = parse_configs(["--config", path], prog="example", extra_sections=extra)
    assert configs.model.num_layers >= 1
    if extra:
        assert configs.model.farskip != "none" and configs.extra["fcsd"].patience >= 1
