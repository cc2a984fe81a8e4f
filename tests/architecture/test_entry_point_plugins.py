"""Variants from installed packages: entry points of the group ``moe_variants`` (the model side,
``moe_variants.registry``) and ``moe_variants.tools`` (the benchmarks' side, ``tools.variants``),
loaded after the built-ins. An entry point names a module that registers when imported, a class,
or a callable; a plugin that fails is one line naming it and its distribution.

The distributions here are written as pip installs them (``NAME-VERSION.dist-info`` with
``METADATA`` and ``entry_points.txt`` beside the modules) into a temporary directory on the path of
a fresh interpreter, so that each case sees a registry that has not loaded yet.
``test_external_variant.py`` builds and installs a real package with pip and runs it end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron.common.cli import UserError
from megatron.common.plugins import load_plugins

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOY_VARIANT = '''
import dataclasses
from moe_variants.registry import Variant, VariantConfig, register

@dataclasses.dataclass
class ToyConfig(VariantConfig):
    SECTION = "toy-plugin"
    toy_plugin_scale: float = 1.0
    """scale of the toy layer"""

@register
class ToyPlugin(Variant):
    name = "toy-plugin"
    config = ToyConfig
    moe_layer = "toy-plugin"
    bench_presets = {"toy-plugin": {"moe_variant": "toy-plugin"}}
'''

TOY_TOOLS = '''
from tools.variants import VariantTools

class ToyPluginTools(VariantTools):
    name = "toy-plugin"
    bench_runtimes = ("toy-plugin-runtime",)
'''


def install_fake(root, dist: str, entry_points: dict, modules: dict) -> None:
    """Write distribution ``dist`` 0.1 into ``root`` as pip would: its modules and a dist-info with
    ``entry_points`` ({group: {name: value}})."""
    info = os.path.join(root, f"{dist.replace('-', '_')}-0.1.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        for group, points in entry_points.items():
            f.write(f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items()))
    for name, source in modules.items():
        with open(os.path.join(root, f"{name}.py"), "w") as f:
            f.write(textwrap.dedent(source))


def _python(root, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), REPO])), timeout=120)


def test_load_plugins_hands_each_entry_point_over_in_name_order(tmp_path, monkeypatch):
    install_fake(tmp_path, "two-plugins", {"test-plugins-order": {"b": "mod_b:VALUE", "a": "mod_a"}},
                 {"mod_a": "", "mod_b": "VALUE = int\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    assert load_plugins("test-plugins-order", int, seen.append) == ["a", "b"]
    assert seen == [int]  # a module registers by being imported; a subclass of the base is handed over
    assert load_plugins("test-plugins-none", int, seen.append) == []


def test_a_failing_plugin_is_one_line_naming_it_and_its_distribution(tmp_path, monkeypatch):
    install_fake(tmp_path, "broken-plugin", {"test-plugins-broken": {"broken": "broken_mod"}},
                 {"broken_mod": "import no_such_module_anywhere\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError) as err:
        load_plugins("test-plugins-broken", object, lambda cls: None)
    assert str(err.value) == ("test-plugins-broken plugin broken = broken_mod (from broken-plugin 0.1) failed to load: "
                              "ModuleNotFoundError: No module named 'no_such_module_anywhere'")


def test_a_plugin_variant_is_registered_after_the_built_ins(tmp_path):
    """Its config section, ``--moe-variant`` value and preset come with it; the tools' plugin adds
    its run-time bench variant."""
    install_fake(tmp_path, "toy-plugin", {"moe_variants": {"toy": "toy_plugin_variant"},
                                          "moe_variants.tools": {"toy": "toy_plugin_tools:ToyPluginTools"}},
                 {"toy_plugin_variant": TOY_VARIANT, "toy_plugin_tools": TOY_TOOLS})
    proc = _python(tmp_path, """
        import json
        from moe_variants import registry
        from tools import variants as variant_hooks
        print(json.dumps({"variants": [v.name for v in registry.variants()],
                          "choices": registry.moe_layer_choices(), "sections": list(registry.config_sections()),
                          "preset": registry.preset_overrides("toy-plugin"),
                          "runtimes": list(variant_hooks.runtime_names()),
                          "tools": [t.name for t in variant_hooks.variant_tools()]}))
    """)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["variants"][-1] == "toy-plugin" and {"bigmac", "farskip", "semmoe"} <= set(out["variants"][:-1])
    assert out["choices"][-1] == "toy-plugin" and "toy-plugin" in out["sections"]
    assert out["preset"] == {"moe_variant": "toy-plugin"}
    assert "toy-plugin-runtime" in out["runtimes"] and out["tools"][-1] == "toy-plugin"


def test_an_entry_point_may_name_the_variant_class(tmp_path):
    undecorated = TOY_VARIANT.replace("@register\n", "")
    install_fake(tmp_path, "toy-plugin", {"moe_variants": {"toy": "toy_plugin_variant:ToyPlugin"}},
                 {"toy_plugin_variant": undecorated})
    proc = _python(tmp_path, "from moe_variants import registry; print(registry.get('toy-plugin').moe_layer)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "toy-plugin"


@pytest.mark.parametrize("modules,entry_point,message", [
    ({"bad_plugin": "import no_such_module_anywhere\n"}, "bad_plugin",
     "ModuleNotFoundError: No module named 'no_such_module_anywhere'"),
    ({"bad_plugin": TOY_VARIANT.replace('name = "toy-plugin"', 'name = "bigmac"')
      .replace('SECTION = "toy-plugin"', 'SECTION = "bigmac"')}, "bad_plugin",
     "ValueError: variant 'bigmac' is registered twice (BigMac, ToyPlugin)"),
    ({"bad_plugin": TOY_VARIANT.replace('moe_layer = "toy-plugin"', 'moe_layer = "bigmac"')}, "bad_plugin",
     "ValueError: ToyPlugin.moe_layer 'bigmac' is already the bigmac variant's"),
    ({"bad_plugin": "VALUE = 3\n"}, "bad_plugin:VALUE",
     "TypeError: names a int, not a module, a Variant subclass or a callable"),
])
def test_a_broken_variant_plugin_stops_a_command_with_one_line(tmp_path, modules, entry_point, message):
    install_fake(tmp_path, "bad-plugin", {"moe_variants": {"bad": entry_point}}, modules)
    proc = _python(tmp_path, """
        import sys
        from megatron.common.cli import run_cli
        from moe_variants import registry
        sys.exit(run_cli("demo", registry.variants))
    """)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"demo: error: moe_variants plugin bad = {entry_point} (from bad-plugin 0.1) failed "
                                   f"to load: {message}")


def test_tools_of_an_unknown_variant_are_refused(tmp_path):
    install_fake(tmp_path, "toy-tools", {"moe_variants.tools": {"toy": "toy_plugin_tools:ToyPluginTools"}},
                 {"toy_plugin_tools": TOY_TOOLS})
    proc = _python(tmp_path, """
        import sys
        from megatron.common.cli import run_cli
        from tools import variants as variant_hooks
        sys.exit(run_cli("demo", variant_hooks.runtime_names))
    """)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("demo: error: moe_variants.tools plugin toy = toy_plugin_tools:ToyPluginTools "
                                          "(from toy-tools 0.1) failed to load: ValueError: unknown variant 'toy-plugin'")
