"""Config help has one source: the docstring under each field (``megatron.common.fielddocs``), read
by the argument parser's ``--help`` and the generated reference alike."""

from __future__ import annotations

import dataclasses

from megatron.common.fielddocs import field_docs


@dataclasses.dataclass
class _Base:
    size: int = 1
    """how many,
    over two lines"""
    name: str = "x"
    """the name"""
    plain: int = 0


@dataclasses.dataclass
class _Child(_Base):
    name: str = "y"
    """the child's name"""
    extra: float = 0.5  # a comment is no docstring


def test_field_docs_read_the_string_under_each_field():
    assert field_docs(_Base) == {"size": "how many, over two lines", "name": "the name"}
    assert field_docs(_Child) == {"size": "how many, over two lines", "name": "the child's name"}


def test_a_class_defined_in_a_function():
    @dataclasses.dataclass
    class Local:
        depth: int = 2
        """layers deep"""

    assert field_docs(Local) == {"depth": "layers deep"}


def _config_classes() -> dict:
    from distill.fcsd import FCSDConfig
    from megatron.components.arguments import SECTIONS
    from moe_variants import registry

    return {**SECTIONS, **registry.config_sections(), "fcsd": FCSDConfig}


def test_every_flag_is_documented_once_by_its_docstring():
    """Every config field that is a flag has a docstring, and none keeps a second help text in its
    metadata."""
    from megatron.components.arguments import cli_fields

    for name, cls in _config_classes().items():
        docs = field_docs(cls)
        for field in cli_fields(cls):
            assert docs.get(field.name), f"{cls.__name__}.{field.name} ({name}) has no docstring"
            assert "help" not in field.metadata, f"{cls.__name__}.{field.name} keeps a metadata help"


def test_the_parser_shows_the_docstring():
    from megatron.components.arguments import build_parser

    actions = {a.dest: a for a in build_parser("pretrain_gpt")._actions}
    assert actions["lr"].help == "peak learning rate (default: 0.0003)"
    assert actions["farskip_mode"].help == "which sub-block reads the earlier activation (default: full)"
