"""The package layering of docs/ARCHITECTURE.md, enforced on the source (every import, including
those inside functions):

    megatron.common (layer 0)  <-  megatron.compat  <-  moe_variants (model library)  <-
    megatron.components (what the applications share), megatron.training, megatron.inference
    (applications, which never import each other)  <-  tools, distill, scripts (tools);
    netsim is standalone and torch-free, on layer 0 only.

A rule broken here is a dependency the next maintainer cannot see from the folder names. Entry-point
modules (``__main__.py``) are applications wherever they sit and are exempt.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("megatron/common", "megatron/compat", "megatron/components", "megatron/training", "megatron/inference",
            "moe_variants", "tools", "distill",
            "netsim", "scripts")
# layer of a project module, by prefix (longest first); a module may import its own layer or lower
LAYERS = [
    ("megatron.common", 0),
    ("megatron.compat", 1),
    ("moe_variants", 2),
    ("megatron.components", 3),
    ("megatron.training", 3),
    ("megatron.inference", 3),
    ("tools", 4),
    ("distill", 4),
    ("scripts", 4),
]
PROJECT_ROOTS = ("megatron.common", "megatron.compat", "megatron.components", "megatron.training", "megatron.inference",
                 "moe_variants", "tools", "distill",
                 "netsim", "scripts")


def _modules():
    for package in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    yield rel.removesuffix(".__init__"), path


def _imports(module: str, path: str):
    """(imported module, imported names, line) for every import in the file, relative ones resolved."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield target, [a.name for a in node.names], node.lineno


def _layer(module: str):
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def _is_project(module: str) -> bool:
    return any(module == r or module.startswith(r + ".") for r in PROJECT_ROOTS)


def _variant_packages() -> set[str]:
    root = os.path.join(REPO, "moe_variants")
    return {f"moe_variants.{d}" for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "variant.py"))}


ALL = sorted(_modules())
MODULES = {m for m, _ in ALL}


def _violations(rule):
    out = []
    for module, path in ALL:
        if path.endswith("__main__.py"):
            continue
        for target, names, line in _imports(module, path):
            problem = rule(module, target, names)
            if problem:
                out.append(f"{os.path.relpath(path, REPO)}:{line}: {problem}")
    return out


def test_the_scan_sees_the_project():
    names = {m for m, _ in ALL}
    assert {"moe_variants.builder", "megatron.training.step", "tools.bench.cli", "netsim.cli"} <= names
    assert len(_variant_packages()) >= 3


def test_dependencies_flow_one_way():
    def rule(module, target, names):
        own, other = _layer(module), _layer(target)
        if own is None or other is None or not _is_project(target):
            return None
        if other > own:
            return f"{module} (layer {own}) imports {target} (layer {other})"
        return None

    assert _violations(rule) == []


def test_model_library_imports_nothing_from_the_applications():
    def rule(module, target, names):
        if module.startswith("moe_variants") and target.startswith(("megatron.components", "megatron.training",
                                                                     "megatron.inference", "tools", "distill")):
            return f"the model library imports {target}"
        return None

    assert _violations(rule) == []


def test_training_imports_no_variant_module():
    variants = _variant_packages()

    def rule(module, target, names):
        if not module.startswith(("megatron.training", "megatron.components")):
            return None
        for v in variants:
            if target == v or target.startswith(v + "."):
                return f"{module} imports the variant module {target} (go through moe_variants.registry)"
        return None

    assert _violations(rule) == []


APPLICATIONS = ("megatron.training", "megatron.inference")


def _application_problem(module: str, target: str) -> str | None:
    """Why ``module`` may not import ``target``: the applications import each other never, and
    what both use (``megatron.components``) imports neither."""
    def package(name, packages):
        return next((p for p in packages if name == p or name.startswith(p + ".")), None)

    own = package(module, APPLICATIONS + ("megatron.components",))
    other = package(target, APPLICATIONS)
    if own is None or other is None or own == other:
        return None
    if own == "megatron.components":
        return f"{module} imports the application {target}: megatron.components imports neither application"
    return f"{module} imports {target} of the other application: what both use goes to megatron.components"


def test_the_application_rule_on_examples():
    assert _application_problem("megatron.inference.serve", "megatron.training.loading") is not None
    assert _application_problem("megatron.training.evaluate_lm", "megatron.inference.protocol") is not None
    assert _application_problem("megatron.components.loading", "megatron.training.step") is not None
    assert _application_problem("megatron.inference.serve", "megatron.components.loading") is None
    assert _application_problem("megatron.training.step", "megatron.training.data") is None
    assert _application_problem("tools.bench.cli", "megatron.training.pretrain_gpt") is None


def test_the_applications_share_only_the_components():
    assert _violations(lambda module, target, names: _application_problem(module, target)) == []


def _imports_a_variant_module(variants: set, target: str, names=()):
    """The variant package that ``import target`` / ``from target import names`` reaches, or None."""
    for module in (target, *(f"{target}.{n}" for n in names)):
        found = next((v for v in variants if module == v or module.startswith(v + ".")), None)
        if found:
            return found
    return None


def test_the_variant_rule_sees_a_variant_import():
    """The checker of the two rules below, on imports it must and must not flag."""
    variants = {"moe_variants.semmoe", "moe_variants.bigmac"}
    assert _imports_a_variant_module(variants, "moe_variants.semmoe.scheduling") == "moe_variants.semmoe"
    assert _imports_a_variant_module(variants, "moe_variants.bigmac") == "moe_variants.bigmac"
    for fine in ("moe_variants.registry", "moe_variants.config", "moe_variants.common.moe_layer",
                 "moe_variants.builder", "moe_variants.semmoe_extra"):
        assert _imports_a_variant_module(variants, fine) is None
    assert _imports_a_variant_module(variants, "moe_variants", ["config", "semmoe"]) == "moe_variants.semmoe"
    assert _imports_a_variant_module(variants, "moe_variants", ["registry"]) is None


def test_inference_imports_no_variant_module():
    """The server reaches variants only through the registry's hooks (``add_runtime_arguments``,
    ``request_scheduler``, ``serving_model``): ``moe_variants.registry``/``config``/``common``/
    ``builder`` are fine, ``moe_variants.<variant>`` is not."""
    variants = _variant_packages()

    def rule(module, target, names):
        found = module.startswith("megatron.inference") and _imports_a_variant_module(variants, target, names)
        if found:
            return f"the server imports the variant module {found} (go through moe_variants.registry)"
        return None

    assert _violations(rule) == []


def test_layer_0_imports_nothing_of_the_project():
    def rule(module, target, names):
        if module.startswith("megatron.common") and _is_project(target) and not target.startswith("megatron.common"):
            return f"layer 0 imports {target}"
        return None

    assert _violations(rule) == []


# What the applications, tools and netsim may take from the model library: its MoE API. Generic
# helpers (errors, the CLI runner, files, processes, collectives) come from layer 0, and variant
# modules are reached through the registry, except by a variant's own tools (VARIANT_TOOLS).
MODEL_LIBRARY_API = ("moe_variants.config", "moe_variants.registry", "moe_variants.builder",
                     "moe_variants.global_state", "moe_variants.features", "moe_variants.attention",
                     "moe_variants.common.moe_layer",
                     "moe_variants.common.comm", "moe_variants.common.routing", "moe_variants.common.dispatcher",
                     "moe_variants.common.timing", "moe_variants.common.wgrad", "moe_variants.common.experts")
# a tool that exists for one variant may import it: a tool named after it (``tools/semmoe/``,
# ``scripts/profile_bigmac_layer.py``: the variant's name is a word of the module's path), and FCSD
# (``distill``), FarSkip's self-distillation
VARIANT_TOOLS = {"distill": "moe_variants.farskip"}


def _own_variant(module: str):
    """The variant package a tool module exists for, or None."""
    for prefix, variant in VARIANT_TOOLS.items():
        if module == prefix or module.startswith(prefix + "."):
            return variant
    if module.startswith(("tools.", "scripts.")):
        words = set(module.replace(".", "_").split("_"))
        return next((v for v in _variant_packages() if v.rpartition(".")[2] in words), None)
    return None


def _library_import_problem(module: str, target: str, names) -> str | None:
    """Why ``module`` (an application, tool or netsim) may not import ``target`` (names), or None."""
    if not (target == "moe_variants" or target.startswith("moe_variants.")):
        return None
    if module.startswith("netsim"):
        return f"netsim imports the model library ({target})"
    own = _own_variant(module)
    # ``from package import module``: judge each module imported; ``from module import name``: the module
    imported = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES] or [target]
    for name in imported:
        if own and (name == own or name.startswith(own + ".")):
            continue
        if any(name == m or name.startswith(m + ".") for m in MODEL_LIBRARY_API):
            continue
        return f"{module} imports {name}: not the model library's API (generic helpers are in megatron.common; " \
               f"variants through moe_variants.registry)"
    return None


def test_the_library_import_rule_on_examples():
    assert _library_import_problem("megatron.training.data", "moe_variants.common.cli", []) is not None
    assert _library_import_problem("netsim.cli", "moe_variants.common.files", []) is not None
    assert _library_import_problem("megatron.inference.engine", "moe_variants.semmoe.tables", []) is not None
    assert _library_import_problem("tools.bench.cli", "moe_variants", ["semmoe"]) is not None
    assert _library_import_problem("tools.semmoe.cli", "moe_variants.semmoe.tables", []) is None
    assert _library_import_problem("distill.fcsd", "moe_variants.farskip.config", []) is None
    assert _library_import_problem("distill.fcsd", "moe_variants.semmoe.tables", []) is not None
    assert _library_import_problem("scripts.profile_bigmac_layer", "moe_variants.bigmac.layer", []) is None
    assert _library_import_problem("scripts.profile_bigmac_layer", "moe_variants.semmoe", []) is not None
    assert _library_import_problem("megatron.training.step", "moe_variants.common.moe_layer", []) is None
    assert _library_import_problem("megatron.training.step", "moe_variants", ["registry"]) is None
    assert _library_import_problem("megatron.training.step", "megatron.common.cli", []) is None


def test_applications_tools_and_netsim_use_only_the_model_library_api():
    def rule(module, target, names):
        if module.startswith(("megatron.components", "megatron.training", "megatron.inference", "tools", "distill",
                              "scripts", "netsim")):
            return _library_import_problem(module, target, names)
        return None

    assert _violations(rule) == []


def test_no_variant_imports_another():
    """What two variants share goes down a layer (moe_variants.common)."""
    variants = _variant_packages()

    def rule(module, target, names):
        own = next((v for v in variants if module == v or module.startswith(v + ".")), None)
        found = own and _imports_a_variant_module(variants - {own}, target, names)
        return f"the variant {own} imports the variant {found}" if found else None

    assert _violations(rule) == []


def test_netsim_imports_only_the_standard_library_helpers():
    def rule(module, target, names):
        if module.startswith("netsim") and _is_project(target) and not target.startswith("netsim"):
            if target not in ("megatron.common.files", "megatron.common.cli", "megatron.common.process"):
                return f"netsim imports {target}"
        return None

    assert _violations(rule) == []


def test_netsim_imports_no_torch():
    code = ("import sys, netsim.cli, netsim.fit, netsim.sweep, netsim.plots, netsim.serving; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr


def test_no_private_names_across_modules():
    def rule(module, target, names):
        if not _is_project(target):
            return None
        same_package = target.rpartition(".")[0] == module.rpartition(".")[0] or target.startswith(module + ".")
        private_parts = [p for p in target.split(".") if p.startswith("_") and not p.startswith("__")]
        if private_parts and not same_package:
            return f"imports the private module {target}"
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if private and target != module:
            return f"imports private name(s) {', '.join(private)} from {target}"
        return None

    assert _violations(rule) == []


@pytest.mark.parametrize("module", ["moe_variants.config", "moe_variants.registry", "megatron.common.files",
                                    "megatron.common.cli"])
def test_light_modules_stay_light(module):
    """Configs, the registry and the stdlib helpers import without megatron-core (configs are
    parsed, validated and printed by tools that never build a model)."""
    code = f"import sys, {module}; bad = [m for m in ('megatron.core', 'torch') if m in sys.modules]; assert not bad, bad"
    if module in ("moe_variants.config", "moe_variants.registry"):
        code = f"import sys, {module}; assert 'megatron.core' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr
