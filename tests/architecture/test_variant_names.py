"""The tools and the applications name no variant: they loop over the registries (``moe_variants.registry``,
``tools.variants``).

The rule: outside the folder of a variant's own tools (``tools/<variant>/``: ``tools/semmoe``, ``tools/bigmac``,
whose folder name is a registered variant's), no Python file under ``tools/`` mentions a name the
registries give a variant (``tools.variants.variant_names()``: the variants, their presets, the
tools' run-time bench variants and placed serving variants, e.g. bigmac, farskip, farskip-simple,
semmoe, eplb; ``standard``, every variant off, is not one) in code: in an identifier (a name,
attribute, function, class, argument, keyword or import) or in a string that is not a docstring.
What a tool does must come from the registry's hooks, so a new variant needs no edit in the tools
and a removed one leaves nothing behind. Prose may name a variant: docstrings and comments explain
which variant a generic mechanism serves today, and they are not in the AST that is checked.
Matching is case-insensitive and ignores ``-`` vs ``_`` (``semmoe_tables``, ``SemMoEBench`` and
``"farskip-simple"`` all count). The checker is tried on snippets first.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from tools import variants as variant_hooks

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _norm(text: str) -> str:
    return text.lower().replace("-", "_")


def _docstrings(tree) -> set[int]:
    """ids of the string constants that are documentation: every bare string statement (the
    docstrings of modules, classes and functions, and attribute docstrings)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def _code_words(tree):
    """(line, text) of every identifier and every non-docstring string constant in ``tree``."""
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield line, node.value
        elif isinstance(node, ast.Name):
            yield line, node.id
        elif isinstance(node, ast.Attribute):
            yield line, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield line, node.name
        elif isinstance(node, ast.arg):
            yield line, node.arg
        elif isinstance(node, ast.keyword) and node.arg:
            yield line, node.arg
        elif isinstance(node, ast.alias):
            yield line, node.name
            if node.asname:
                yield line, node.asname
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield line, node.module
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for name in node.names:
                yield line, name


def variant_mentions(source: str, names) -> list[tuple[int, str, str]]:
    """(line, name, where) for each mention of one of ``names`` in the code of ``source``."""
    wanted = [(_norm(n), n) for n in names]
    found = []
    for line, text in _code_words(ast.parse(source)):
        for key, name in wanted:
            if key in _norm(text):
                found.append((line, name, text if len(text) < 60 else text[:57] + "..."))
    return sorted(set(found))


NAMES = ["bigmac", "farskip", "farskip-simple", "semmoe", "eplb"]


@pytest.mark.parametrize("source", [
    'if "semmoe" in variant.split("+"):\n    pass',
    "x = args.semmoe_tables",
    "from tools.semmoe.bench import from_worker",
    "import moe_variants.bigmac.layer",
    "def place_eplb(x):\n    return x",
    "class SemMoEBench:\n    pass",
    "def f(bigmac_model=None):\n    pass",
    "f(farskip=True)",
    'PLACED = ("eplb", "x")',
    'ap.add_argument("--variants", default="standard,bigmac")',
    'ap.add_argument("--x", help="e.g. Farskip-Simple")',
    'msg = f"--variants {v}: only FarSkip"',
])
def test_checker_finds_a_variant_name(source):
    assert variant_mentions(source, NAMES), source


@pytest.mark.parametrize("source", [
    '"""Sem-MoE placements (eplb, semmoe) and BigMac: documentation."""\nx = 1',
    "def f():\n    '''farskip-simple is documented here'''\n    return 1  # bigmac in a comment",
    'x = "standard"\nvariants = variant_hooks.runtime_names()',
    "y = {'deepspeed-moe': 1, 'mcore-latent': 2}",
])
def test_checker_allows_the_rest(source):
    assert variant_mentions(source, NAMES) == []


def _variant_tool_folders() -> set[pathlib.Path]:
    return {ROOT / "tools" / name for name in variant_hooks.variant_names() if (ROOT / "tools" / name).is_dir()}


def test_the_rule_sees_the_registry_and_the_tools():
    names = variant_hooks.variant_names()
    assert {"bigmac", "farskip", "semmoe", "eplb"} <= set(names) and "standard" not in names
    assert _variant_tool_folders() == {ROOT / "tools" / "semmoe", ROOT / "tools" / "bigmac"}
    assert len(list((ROOT / "tools").rglob("*.py"))) > 30


# the docs reference generator lists every entry point by its module path, a variant's tool among them
NAMES_ENTRY_POINTS = {ROOT / "tools" / "docs" / "reference.py"}


def test_the_tools_name_no_variant():
    names = variant_hooks.variant_names()
    exempt = _variant_tool_folders()
    offenders = []
    for path in sorted((ROOT / "tools").rglob("*.py")):
        if any(folder in path.parents for folder in exempt) or path in NAMES_ENTRY_POINTS:
            continue
        for line, name, text in variant_mentions(path.read_text(), names):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {name} in {text!r}")
    assert not offenders, "the tools must go through the registry's hooks:\n" + "\n".join(offenders)


# the applications (training, evaluate_lm, the server) and the layers below them: generic code
APPLICATIONS = ("megatron/common", "megatron/compat", "megatron/components", "megatron/training", "megatron/inference")


def test_the_applications_name_no_variant():
    """Generic code reads no variant's flag or name (``args.semmoe_tables`` in evaluate_lm was one):
    what a variant refuses or adds there comes from a registry hook (``check_runtime``,
    ``request_scheduler``, ``serving_model``, ``add_runtime_arguments``)."""
    names = variant_hooks.variant_names()
    offenders = []
    files = [p for pkg in APPLICATIONS for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 40
    for path in files:
        for line, name, text in variant_mentions(path.read_text(), names):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {name} in {text!r}")
    assert not offenders, "the applications must go through the registry's hooks:\n" + "\n".join(offenders)
