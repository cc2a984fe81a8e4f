"""The GPU tier (tests/gpu) cannot run on CPU CI, so a stale import inside one of its rank
functions would only show on a GPU machine, and there as a failure that could be mistaken for a
hardware refusal. Every ``from X import Y`` in tests/gpu, at module level or inside functions, is
resolved here: the module imports and has the name. The checker is tried on a stale snippet first.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def unresolved_imports(source: str) -> list[str]:
    """``module.name`` of each ``from module import name`` in ``source`` that does not resolve."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                bad.append(node.module)
                continue
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        bad.append(f"{node.module}.{alias.name}")
    return bad


def test_checker_finds_a_stale_import():
    stale = "def rank_fn():\n    from megatron.training.training import no_such_name\n"
    assert unresolved_imports(stale) == ["megatron.training.training.no_such_name"]


def test_every_import_of_the_gpu_tier_resolves():
    for path in sorted((ROOT / "tests" / "gpu").glob("*.py")):
        assert unresolved_imports(path.read_text()) == [], path.name
