"""The registry of ``python -m tools.semmoe`` subcommands: ``cli.py`` registers the table commands,
``model_commands.py`` the model-side ones; ``cli.main`` runs them."""

from megatron.common.cli import Subcommands

COMMANDS = Subcommands("python -m tools.semmoe", "Sem-MoE offline passes: profile, solve, evaluate, apply, lar")
command = COMMANDS.add

__all__ = ["COMMANDS", "command"]
