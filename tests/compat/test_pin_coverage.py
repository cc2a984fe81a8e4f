"""Every upstream pin in megatron/compat is checked by ``test_staleness.test_upstream_site_unchanged``.

Pins are found by what they are, not by what their list is called: on the AST of every module of
the package, a module-level name whose value holds ``Site(...)`` calls or ``("<file>.py", ...)``
tuples (the line-number format pins had before). Each such value's every element must be among the
sites the staleness test is parametrized with, so a pin list added under any name, or left out of
the staleness test's discovery, fails here.
"""

import ast
import importlib
import pathlib

from megatron import compat
from tests.compat import test_staleness


def _is_pin(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        return getattr(node.func, "id", getattr(node.func, "attr", None)) == "Site"
    return (isinstance(node, ast.Tuple) and bool(node.elts) and isinstance(node.elts[0], ast.Constant)
            and isinstance(node.elts[0].value, str) and node.elts[0].value.endswith(".py"))


def pin_holders() -> list[tuple[str, str]]:
    """``(module, name)`` of every module-level name of megatron/compat bound to a value holding pins."""
    holders = []
    for path in sorted(pathlib.Path(compat.__file__).parent.glob("*.py")):
        for stmt in ast.parse(path.read_text()).body:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names and stmt.value is not None and any(_is_pin(n) for n in ast.walk(stmt.value)):
                holders += [(f"megatron.compat.{path.stem}", name) for name in names]
    return holders


def _checked() -> list:
    """The values ``test_upstream_site_unchanged`` is parametrized with."""
    (mark,) = [m for m in test_staleness.test_upstream_site_unchanged.pytestmark if m.name == "parametrize"]
    return list(mark.args[1])


def test_pin_holders_are_found():
    """The scan itself: the package's pin lists are seen (so the check below is not vacuous)."""
    found = pin_holders()
    assert ("megatron.compat.sites", "CPU_DEVICE_SITES") in found
    assert ("megatron.compat.mla", "MLA_SERVING_SITES") in found
    assert ("megatron.compat.sites", "TORCH_PRIVATE_APIS") not in found  # torch names, not upstream pins


def test_every_pin_is_checked():
    checked = _checked()
    unchecked = {}
    for module, name in pin_holders():
        pins = getattr(importlib.import_module(module), name)
        missing = [pin for pin in pins if pin not in checked]
        if missing:
            unchecked[f"{module}.{name}"] = f"{len(missing)} of {len(pins)}, e.g. {missing[0]}"
    assert not unchecked, f"upstream pins no staleness test checks: {unchecked}"
