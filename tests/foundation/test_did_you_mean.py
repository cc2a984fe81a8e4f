"""An unknown option names the nearest known one (``difflib``): a YAML key of ``--config``, a
flag of the training commands, a flag of the server and of the evaluator. Exact strings."""

from __future__ import annotations

import pytest

from megatron.common.cli import did_you_mean


def test_did_you_mean_names_the_nearest_known_name_or_nothing():
    known = ["num_layers", "num_experts", "hidden_size"]
    assert did_you_mean("num_layer", known) == " (did you mean num_layers?)"
    assert did_you_mean("hiden_size", known) == " (did you mean hidden_size?)"
    assert did_you_mean("learning_rate_schedule", known) == ""


def test_a_yaml_typo_suggests_the_option(tmp_path):
    from megatron.components.arguments import parse_configs

    config = tmp_path / "c.yaml"
    config.write_text("num_layer: 2\nhidden_size: 64\n")
    with pytest.raises(ValueError) as err:
        parse_configs(["--config", str(config)])
    assert str(err.value) == f"--config {config}: unknown option(s): num_layer (did you mean num_layers?)"


def test_a_flag_typo_suggests_the_flag(capsys):
    from megatron.components.arguments import parse_configs

    with pytest.raises(SystemExit) as exit_:
        parse_configs(["--num-layer", "2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("pretrain_gpt: error: unrecognized arguments: --num-layer 2 "
                                       "(did you mean --num-layers?)\n")


@pytest.mark.parametrize("module, argv, needle", [
    ("megatron.inference.serve", ["--load", "x", "--stall-timout", "3"], "--stall-timout 3 (did you mean --stall-timeout?)"),
    ("megatron.training.evaluate_lm", ["--load", "x", "--tasks", "arc", "--output", "o.json", "--limt", "3"],
     "--limt 3 (did you mean --limit?)"),
])
def test_server_and_evaluator_flag_typos_suggest_the_flag(module, argv, needle, capsys):
    import importlib

    parser = importlib.import_module(module).build_parser()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err
