"""No command reports a plain ``ValueError`` as bad input.

``run_cli`` / ``Subcommands.main`` print the exceptions in ``user_errors`` as one ``error:`` line
with no traceback. A ``ValueError`` there would turn every bug that raises one (a shape mismatch
deep in a forward, from torch or megatron-core) into a one-line "user error"; bad input is a
``UserError`` (``megatron.common.cli``). The AST check below finds ``ValueError`` in any
``user_errors`` tuple: a keyword argument, a parameter default, or what a function named
``user_errors`` returns; and the same mistake written by hand, an ``except ValueError`` that prints
an ``error:`` line itself. It is tested on snippets first, so a broken checker cannot pass silently.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ["megatron/common", "megatron/components", "megatron/training", "megatron/inference", "megatron/compat",
            "moe_variants", "distill", "tools", "netsim", "scripts"]
BROAD = {"ValueError", "Exception", "BaseException"}


def _broad(expr) -> list[str]:
    """The too-broad exception names in a ``user_errors`` value (a name or a tuple/list of names)."""
    items = expr.elts if isinstance(expr, (ast.Tuple, ast.List)) else [expr]
    names = [i.id if isinstance(i, ast.Name) else i.attr if isinstance(i, ast.Attribute) else None for i in items]
    return [n for n in names if n in BROAD]


def broad_user_errors(source: str) -> list[tuple[int, str]]:
    """(line, exception name) for each too-broad exception in a ``user_errors`` tuple of ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        values = []
        if isinstance(node, ast.keyword) and node.arg == "user_errors":
            values.append(node.value)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
                if arg.arg == "user_errors":
                    values.append(default)
            for arg, default in zip(args.kwonlyargs, args.kw_defaults):
                if arg.arg == "user_errors" and default is not None:
                    values.append(default)
            if node.name == "user_errors":
                values += [n.value for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "user_errors" for t in targets) and node.value is not None:
                values.append(node.value)
        for value in values:
            found += [(value.lineno, name) for name in _broad(value)]
    return found


@pytest.mark.parametrize("snippet,expected", [
    ("run_cli('p', body, user_errors=(ValueError, CheckpointError))", ["ValueError"]),
    ("COMMANDS.main(argv, user_errors=(builtins.ValueError,))", ["ValueError"]),
    ("run_cli('p', body, user_errors=ValueError)", ["ValueError"]),
    ("def run_cli(prog, body, *, user_errors: tuple = (ValueError,)): pass", ["ValueError"]),
    ("def main(self, argv, user_errors=[Exception]): pass", ["Exception"]),
    ("def user_errors():\n    return (UserError, ValueError)", ["ValueError"]),
    ("user_errors = (ValueError, OSError)\nrun_cli('p', body, user_errors=user_errors)", ["ValueError"]),
    ("run_cli('p', body, user_errors=(UserError, CheckpointError, CheckpointException))", []),
    ("def run_cli(prog, body, *, user_errors: tuple = (UserError,)): pass", []),
    ("try:\n    f()\nexcept ValueError:\n    pass", []),
])
def test_checker_finds_value_error_in_user_errors(snippet, expected):
    assert [name for _, name in broad_user_errors(snippet)] == expected


def hand_rolled_reports(source: str) -> list[int]:
    """Lines of ``except`` handlers that catch ``ValueError`` (or broader) and print an ``error:``
    line themselves."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ExceptHandler) or node.type is None or not _broad(node.type):
            continue
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
            texts = [c.value for a in call.args for c in ast.walk(a) if isinstance(c, ast.Constant)]
            if name in ("print", "write") and any(isinstance(t, str) and "error:" in t for t in texts):
                found.append(node.lineno)
                break
    return found


@pytest.mark.parametrize("snippet,expected", [
    ("try:\n    run()\nexcept ValueError as e:\n    print(f'prog: error: {e}', file=sys.stderr)", [3]),
    ("try:\n    run()\nexcept (ValueError, OSError) as e:\n    sys.stderr.write('prog: error: ' + str(e))", [3]),
    ("try:\n    run()\nexcept UserError as e:\n    print(f'prog: error: {e}', file=sys.stderr)", []),
    ("try:\n    run()\nexcept ValueError:\n    log.warning('skipped a bad line')", []),
])
def test_checker_finds_hand_rolled_value_error_reports(snippet, expected):
    assert hand_rolled_reports(snippet) == expected


def project_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))


def offenders(root: pathlib.Path) -> list[str]:
    out = []
    for p in project_files(root):
        source = p.read_text()
        out += [f"{p.relative_to(root)}:{line}: {name} in user_errors" for line, name in broad_user_errors(source)]
        out += [f"{p.relative_to(root)}:{line}: except ValueError printing an error: line"
                for line in hand_rolled_reports(source)]
    return out


def test_no_command_reports_a_value_error_as_bad_input():
    files = project_files(ROOT)
    assert any(p.name == "cli.py" and p.parent.name == "common" for p in files)  # the scan sees the tree
    found = offenders(ROOT)
    assert not found, "bad input is a UserError (megatron.common.cli), not a ValueError:\n" + "\n".join(found)
