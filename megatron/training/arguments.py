"""Command line and YAML for the torchrun entry points, with Megatron-LM's flag names.

Every field of the config dataclasses is a flag (``moe_router_topk`` -> ``--moe-router-topk``) and a
YAML key (either spelling): the core sections below, every registered variant's section
(``moe_variants.registry``: ``--bigmac-ratio``, ``--farskip``, ...) and an entry point's extra
sections. Precedence: dataclass defaults < ``--config FILE.yaml`` < flags. An unknown flag or YAML
key is an error that names it. Booleans take ``--flag`` / ``--no-flag``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import sys
import typing
from typing import Any, Optional, Sequence, Union

import yaml

from megatron.training.config import CheckpointConfig, DataConfig, LoggingConfig, TrainingConfig
from moe_variants import registry
from moe_variants.config import ModelConfig, ParallelConfig, plain_fields

__all__ = ["Configs", "parse_configs", "build_parser", "SECTIONS", "configs_to_dict", "configs_from_dict", "option_names"]

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


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


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


def _cli_fields(cls) -> list:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def _add_field(group, field: dataclasses.Field, hint) -> None:
    origin = typing.get_origin(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if origin is Union and len(args) == 1:
        hint, origin, args = args[0], typing.get_origin(args[0]), list(typing.get_args(args[0]))
    flag = _flag(field.name)
    if hint is bool:
        group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction)
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        group.add_argument(flag, dest=field.name, choices=[m.value for m in hint], metavar=hint.__name__.upper())
    elif hint is list or origin is list:
        group.add_argument(flag, dest=field.name, nargs="+")
    elif origin is Union:  # moe_layer_freq: int or list
        group.add_argument(flag, dest=field.name, type=_parse_layer_freq)
    elif hint in (int, float, str):
        group.add_argument(flag, dest=field.name, type=hint)
    elif isinstance(hint, type) and hasattr(hint, "parse"):  # a typed value parsed from its text
        group.add_argument(flag, dest=field.name, type=str)
    else:
        raise TypeError(f"no CLI mapping for {field.name}: {hint}")


def build_parser(prog: str, extra_sections: Optional[dict] = None) -> argparse.ArgumentParser:
    """Parser with every config field as a flag; values absent from the command line stay unset."""
    parser = OneLineParser(prog=prog, argument_default=argparse.SUPPRESS, allow_abbrev=False)
    parser.add_argument("--config", dest="config", help="YAML file with the same keys as the flags")
    for name, cls in _all_sections(extra_sections).items():
        group = parser.add_argument_group(name)
        hints = typing.get_type_hints(cls)
        for field in _cli_fields(cls):
            _add_field(group, field, hints[field.name])
    return parser


def option_names(extra_sections: Optional[dict] = None) -> set:
    """Every config field name (the flags without ``--``) of the core and variant sections."""
    return set(_field_owner(_all_sections(extra_sections)))


def _field_owner(sections: dict) -> dict:
    owner = {}
    for name, cls in sections.items():
        for field in _cli_fields(cls):
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
) -> Configs:
    """Parse flags (+ optional YAML) into the config dataclasses. Raises ``ValueError`` (or exits 2
    on a malformed command line) naming the bad option."""
    sections = _all_sections(extra_sections)
    parser = build_parser(prog, extra_sections)
    flags = vars(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))
    config_path = flags.pop("config", None)
    values = dict(defaults or {})
    if config_path:
        from_yaml = load_yaml(config_path)
        owner = _field_owner(sections)
        unknown = sorted(k for k in from_yaml if k not in owner)
        if unknown:
            raise ValueError(f"--config {config_path}: unknown option(s): {', '.join(unknown)}")
        values.update(from_yaml)
    values.update(flags)
    return configs_from_dict(values, extra_sections)


def configs_from_dict(values: dict, extra_sections: Optional[dict] = None) -> Configs:
    """Build the dataclasses from one flat dict of field values (validated by their constructors);
    the variants' sections become ``model.variants``."""
    sections = _all_sections(extra_sections)
    owner = _field_owner(sections)
    per_section: dict[str, dict[str, Any]] = {name: {} for name in sections}
    for key, value in values.items():
        if key not in owner:
            raise ValueError(f"unknown option: {_flag(key)}")
        per_section[owner[key]][key] = value
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
