"""``megatron.common.cli``: a ``UserError`` is one ``error:`` line and exit status 2; any other
exception, a ``ValueError`` from deep inside a command included, keeps its traceback (status 1
from the interpreter), by default in ``run_cli`` and ``Subcommands.main`` alike."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from megatron.common.cli import Subcommands, UserError, run_cli, user_input

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _commands() -> Subcommands:
    commands = Subcommands("prog")

    @commands.add("bad", "a user error", lambda p: p.add_argument("--lr", type=float))
    def _bad(args):
        if args.lr < 0:
            raise UserError(f"--lr must be >= 0, got {args.lr:g}")

    @commands.add("bug", "a bug deep inside", lambda p: None)
    def _bug(args):
        raise ValueError("shape mismatch deep inside a forward")

    return commands


def test_user_errors_are_one_line_by_default(capsys):
    def marked():
        with user_input():
            raise ValueError("--data x.jsonl:2: not valid JSON")

    assert run_cli("prog", marked) == 2
    assert capsys.readouterr().err == "prog: error: --data x.jsonl:2: not valid JSON\n"
    assert _commands().main(["bad", "--lr", "-1"]) == 2
    assert capsys.readouterr().err == "prog: error: --lr must be >= 0, got -1\n"
    assert _commands().main(["bad", "--lr", "x"]) == 2  # argparse's own one line
    assert "invalid float value" in capsys.readouterr().err


def test_a_value_error_deep_inside_keeps_its_traceback(capsys):
    def deep_bug():
        raise ValueError("shape mismatch deep inside a forward")

    with pytest.raises(ValueError, match="shape mismatch"):
        run_cli("prog", deep_bug)
    with pytest.raises(ValueError, match="shape mismatch"):
        _commands().main(["bug"])
    assert "error:" not in capsys.readouterr().err


@pytest.mark.parametrize("call", ["run_cli('prog', deep_bug)", "_commands().main(['bug'])"])
def test_a_command_with_a_bug_exits_1_with_the_traceback(call):
    code = textwrap.dedent(f"""
        import sys
        from tests.foundation.test_cli import _commands
        from megatron.common.cli import run_cli

        def deep_bug():
            raise ValueError("shape mismatch deep inside a forward")

        sys.exit({call})
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "ValueError: shape mismatch deep inside a forward"
    assert "error:" not in proc.stderr
