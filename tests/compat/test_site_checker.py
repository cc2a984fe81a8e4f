"""``sites.site_problem`` on a synthetic upstream file and its "upgrades": a pin holds while its
text stays on a line of its function, wherever the function moves; it fails, naming path, function
and text, when the text changes, moves to another function or the function disappears."""

import textwrap

from megatron.compat.sites import MODULE, Site, enclosing, site_problem

UPSTREAM = textwrap.dedent('''\
    import torch

    buffer = torch.zeros([1], device="cuda")


    class Layer:
        @staticmethod
        def build(size):
            return torch.empty(size, device="cuda")

        def forward(self, x):
            def inner(y):
                return y.cuda()

            return inner(x) + 1


    try:
        from flash_attn import kernel
    except ImportError:
        kernel = None
''')

PINS = [
    Site("layer.py", MODULE, 'buffer = torch.zeros([1], device="cuda")'),
    Site("layer.py", MODULE, "kernel = None"),
    Site("layer.py", "Layer.build", 'torch.empty(size, device="cuda")'),
    Site("layer.py", "Layer.build", "@staticmethod"),
    Site("layer.py", "Layer.forward", "return inner(x) + 1"),
    Site("layer.py", "Layer.forward.inner", "return y.cuda()"),
]


def test_pins_hold_on_their_source():
    assert [site_problem(site, UPSTREAM) for site in PINS] == [None] * len(PINS)


def test_moved_lines_pass():
    moved = UPSTREAM.replace("import torch\n", "import os\nimport torch\n\n\ndef helper():\n    return os.sep\n")
    moved = moved.replace("    @staticmethod", "    scale = 2\n\n    @staticmethod")
    line = "            return y.cuda()"
    assert moved.splitlines().index(line) > UPSTREAM.splitlines().index(line)
    assert [site_problem(site, moved) for site in PINS] == [None] * len(PINS)


def test_changed_text_fails_naming_the_site():
    changed = UPSTREAM.replace('torch.empty(size, device="cuda")', "torch.empty(size)")
    problems = [site_problem(site, changed) for site in PINS]
    assert problems[:2] + problems[3:] == [None] * (len(PINS) - 1)
    assert problems[2] == ("megatron/core/layer.py Layer.build: 'torch.empty(size, device=\"cuda\")': "
                           "no longer in Layer.build, nor anywhere else in the file")


def test_text_moved_into_another_function_fails():
    moved = UPSTREAM.replace("            return y.cuda()", "            return y").replace(
        '        return torch.empty(size, device="cuda")',
        '        y = torch.empty(size, device="cuda")\n        return y.cuda()')
    problems = [site_problem(site, moved) for site in PINS]
    assert problems[:5] == [None] * 5  # Layer.build gained a line: its own pins still hold
    assert problems[5] == ("megatron/core/layer.py Layer.forward.inner: 'return y.cuda()': no longer in "
                           "Layer.forward.inner; it is now at line 10, in Layer.build")


def test_module_text_moved_into_a_function_fails():
    moved = UPSTREAM.replace("    kernel = None\n", "    def kernel():\n        kernel = None\n")
    problem = site_problem(PINS[1], moved)
    assert problem == ("megatron/core/layer.py <module>: 'kernel = None': no longer in <module>; "
                       "it is now at line 22, in kernel")


def test_removed_function_fails():
    renamed = UPSTREAM.replace("def build(size)", "def make(size)")
    assert site_problem(PINS[2], renamed) == (
        "megatron/core/layer.py Layer.build: 'torch.empty(size, device=\"cuda\")': "
        "Layer.build is no longer defined in the file")


def test_enclosing_names_the_innermost_scope():
    lines = UPSTREAM.splitlines()
    assert enclosing(UPSTREAM, lines.index("            return y.cuda()") + 1) == "Layer.forward.inner"
    assert enclosing(UPSTREAM, lines.index("    @staticmethod") + 1) == "Layer.build"
    assert enclosing(UPSTREAM, lines.index("class Layer:") + 1) == "Layer"
    assert enclosing(UPSTREAM, 3) == MODULE
