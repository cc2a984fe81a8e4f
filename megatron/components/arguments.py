"""Command line and YAML for the torchrun entry points, with Megatron-LM's flag names.

Every field of the config dataclasses is a flag (``moe_router_topk`` -> ``--moe-router-topk``) and a
YAML key (either spelling): the core sections below, every registered variant's section
(``moe_variants.registry``: ``--bigmac-ratio``, ``--farskip``, ...) and an entry point's extra
sections. Precedence: dataclass defaults < ``--config FILE.yaml`` < flags. An unknown flag or YAML
key is an error that names it and the nearest known one. Booleans take ``--flag`` / ``--no-flag``. A
flag's help is the docstring under its field (``megatron.common.fielddocs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import re
import sys
import typing
from typing import Any, Optional, Sequence, Union

import yaml

from megatron.common.cli import ArgumentParser, did_you_mean
from megatron.common.fielddocs import field_docs
from megatron.components.config import CheckpointConfig, DataConfig, LoggingConfig, TrainingConfig
from moe_variants import registry
from moe_variants.config import ModelConfig, ParallelConfig, plain, plain_fields

__all__ = ["Configs", "parse_configs", "build_parser", "SECTIONS", "configs_to_dict", "configs_from_dict", "option_names",
           "cli_fields", "default_of", "config_yaml"]

SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


@dataclasses.dataclass
class Configs:
    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    extra: dict = dataclasses.field(default_factory=dict)  # entry-point specific sections


class OneLineParser(ArgumentParser):
    """argparse that reports a bad command line in one line (no usage dump; an unknown flag names
    the nearest known one)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {self.hinted(message)}\n")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_layer_freq(text: str):
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected an int or a list like [0,1,1], got {text!r}")
    if isinstance(value, int) or (isinstance(value, list) and all(isinstance(v, int) for v in value)):
        return value
    raise argparse.ArgumentTypeError(f"expected an int or a list like [0,1,1], got {text!r}")


def _all_sections(extra_sections: Optional[dict] = None) -> dict:
    """Core sections, the registered variants' sections, then the entry point's own."""
    return {**SECTIONS, **registry.config_sections(), **(extra_sections or {})}


def cli_fields(cls) -> list:
    """The fields of a config dataclass that are flags and YAML keys (``metadata["cli"]`` not false)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def default_of(field: dataclasses.Field):
    """A field's default value (its factory's product), None when it has none."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return None


def _help(field: dataclasses.Field, doc: str) -> str:
    """The flag's help: the field's docstring ``doc`` and its default (the parser itself uses
    SUPPRESS defaults, so argparse cannot show them)."""
    default = plain(default_of(field))
    shown = "unset" if default is None else (
        json.dumps(default) if isinstance(default, (list, dict)) else str(default))
    text = f"{doc} (default: {shown})" if doc else f"(default: {shown})"
    return text.replace("%", "%%")


# string fields whose choices come from the variant registry (shown by --help, checked by argparse)
_DYNAMIC_CHOICES = {"moe_variant": lambda: list(registry.moe_layer_choices())}


def _add_field(group, field: dataclasses.Field, hint, doc: str) -> None:
    origin = typing.get_origin(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if origin is Union and len(args) == 1:
        hint, origin, args = args[0], typing.get_origin(args[0]), list(typing.get_args(args[0]))
    flag = _flag(field.name)
    if hint is bool:
        if field.name.startswith("no_") and default_of(field) is False:
            # Megatron-LM's --no-load-optim style: a plain switch (never --no-no-load-optim)
            group.add_argument(flag, dest=field.name, action="store_true", help=_help(field, doc))
        else:
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, help=_help(field, doc))
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        group.add_argument(flag, dest=field.name, choices=[m.value for m in hint], help=_help(field, doc))
    elif hint is list or origin is list:
        group.add_argument(flag, dest=field.name, nargs="+", help=_help(field, doc))
    elif origin is Union:  # moe_layer_freq: int or list
        group.add_argument(flag, dest=field.name, type=_parse_layer_freq, help=_help(field, doc), metavar="N|[0,1,..]")
    elif field.name in _DYNAMIC_CHOICES:  # a string whose values are registered at run time
        group.add_argument(flag, dest=field.name, choices=_DYNAMIC_CHOICES[field.name](), help=_help(field, doc))
    elif hint in (int, float, str):
        group.add_argument(flag, dest=field.name, type=hint, help=_help(field, doc),
                           metavar={int: "N", float: "X", str: "STR"}[hint])
    elif isinstance(hint, type) and hasattr(hint, "parse"):  # a typed value parsed from its text
        group.add_argument(flag, dest=field.name, type=str, help=_help(field, doc), metavar="STR")
    else:
        raise TypeError(f"no CLI mapping for {field.name}: {hint}")


def build_parser(prog: str, extra_sections: Optional[dict] = None,
                 description: Optional[str] = None) -> argparse.ArgumentParser:
    """Parser with every config field as a flag (its help text and default shown by ``--help``);
    values absent from the command line stay unset."""
    parser = OneLineParser(prog=prog, argument_default=argparse.SUPPRESS, allow_abbrev=False,
                           description=description, usage="%(prog)s [--config FILE.yaml] [--FLAG VALUE ...]",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", dest="config", metavar="FILE.yaml",
                        help="YAML file with the same keys as the flags (either spelling); flags override it")
    for name, cls in _all_sections(extra_sections).items():
        group = parser.add_argument_group(name)
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for field in cli_fields(cls):
            _add_field(group, field, hints[field.name], docs.get(field.name, ""))
    return parser


def option_names(extra_sections: Optional[dict] = None) -> set:
    """Every config field name (the flags without ``--``) of the core and variant sections."""
    return set(_field_owner(_all_sections(extra_sections)))


def _field_owner(sections: dict) -> dict:
    owner = {}
    for name, cls in sections.items():
        for field in cli_fields(cls):
            assert field.name not in owner, f"{field.name} defined in two config sections"
            owner[field.name] = name
    return owner


def load_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def parse_configs(
    argv: Optional[Sequence[str]] = None,
    *,
    prog: str = "pretrain_gpt",
    extra_sections: Optional[dict] = None,
    defaults: Optional[dict] = None,
    description: Optional[str] = None,
) -> Configs:
    """Parse flags (+ optional YAML) into the config dataclasses. Raises ``ValueError`` (or exits 2
    on a malformed command line) naming the bad option."""
    sections = _all_sections(extra_sections)
    parser = build_parser(prog, extra_sections, description)
    flags = vars(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))
    config_path = flags.pop("config", None)
    values = dict(defaults or {})
    if config_path:
        from_yaml = load_yaml(config_path)
        owner = _field_owner(sections)
        unknown = sorted(k for k in from_yaml if k not in owner)
        if unknown:
            raise ValueError(f"--config {config_path}: unknown option(s): "
                             f"{', '.join(k + did_you_mean(k, owner) for k in unknown)}")
        hints = _hints(sections)
        values.update({k: _coerce(k, v, hints[k], f"--config {config_path}: ") for k, v in from_yaml.items()})
    values.update(flags)
    return configs_from_dict(values, extra_sections)


_INT = re.compile(r"^[-+]?\d+$")


def _coerce(name: str, value, hint, where: str = ""):
    """A config value of the field's type, or ``ValueError`` naming the option. YAML 1.1 (PyYAML)
    reads ``3e-3`` as a string, so numbers written that way are accepted as floats."""
    label = f"{where}{name}" if where else _flag(name)
    optional = type(None) in typing.get_args(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is Union and len(args) == 1:
        hint, origin = args[0], typing.get_origin(args[0])
    if value is None:
        if optional:
            return None
        raise ValueError(f"{label}: needs a value")
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return value  # checked against the choices by the dataclass
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{label}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and _INT.match(value.strip()):
            return int(value)
        raise ValueError(f"{label}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{label}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"{label}: expected a string, got {value!r}")
    if hint is list or origin is list:
        if isinstance(value, list):
            return value
        if isinstance(value, str):
            return value.split()
        raise ValueError(f"{label}: expected a list, got {value!r}")
    if origin is Union:  # moe_layer_freq: int or list of ints
        if isinstance(value, str):
            try:
                return _parse_layer_freq(value)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"{label}: {e}") from None
        if (isinstance(value, int) and not isinstance(value, bool)) or (
                isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            return value
        raise ValueError(f"{label}: expected an int or a list like [0,1,1], got {value!r}")
    return value


def _hints(sections: dict) -> dict:
    out = {}
    for cls in sections.values():
        out.update(typing.get_type_hints(cls))
    return out


def configs_from_dict(values: dict, extra_sections: Optional[dict] = None, *, where: str = "") -> Configs:
    """Build the dataclasses from one flat dict of field values: each value is checked against its
    field's type (``ValueError`` naming the option, prefixed by ``where``), then validated by the
    dataclass constructors; the variants' sections become ``model.variants``."""
    sections = _all_sections(extra_sections)
    owner = _field_owner(sections)
    hints = _hints(sections)
    per_section: dict[str, dict[str, Any]] = {name: {} for name in sections}
    for key, value in values.items():
        if key not in owner:
            raise ValueError(f"unknown option: {_flag(key)}{did_you_mean(key, owner)}")
        per_section[owner[key]][key] = _coerce(key, value, hints[key], where)
    variant_sections = registry.config_sections()
    built = {}
    for name, cls in sections.items():
        try:
            built[name] = cls(**per_section[name])
        except TypeError as e:
            raise ValueError(f"bad value in {name} options: {e}") from None
    variants = {name: built.pop(name) for name in variant_sections}
    model = dataclasses.replace(built.pop("model"), variants=variants)
    return Configs(model=model, **{k: built.pop(k) for k in SECTIONS if k != "model"}, extra=built)


def configs_to_dict(configs: Configs) -> dict:
    """JSON-serialisable ``{section: {field: value}}`` (stored in checkpoints and printed): the core
    sections, each variant's section, then the entry point's extra sections."""
    out = {}
    for name in SECTIONS:
        if name == "model":
            out.update(configs.model.dump())
        else:
            out[name] = plain_fields(getattr(configs, name))
    for name, obj in configs.extra.items():
        out[name] = plain_fields(obj)
    return out


def config_yaml(config_dict: dict, prog: str) -> str:
    """The resolved configuration as flat YAML, loadable again with ``--config``."""
    lines = [f"# The resolved configuration of this {prog} run; `--config` accepts this file as is."]
    for section, fields in config_dict.items():
        if section == "tokenizer" or not fields:
            continue
        lines += ["", f"# {section}", yaml.safe_dump(fields, sort_keys=False).rstrip()]
    return "\n".join(lines) + "\n"
