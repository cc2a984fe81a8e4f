"""The variants a bench_serve run compares: the names of ``--variants``, which of them are placed
(a checkpoint pass re-places ``--load``'s experts) and the ``pretrain_gpt`` config each one's
checkpoint is trained with. The flags' checks (``options``) and the checkpoints (``checkpoints``)
both read them."""

from __future__ import annotations

from megatron.common.cli import UserError
from moe_variants import registry
from tools import variants as variant_hooks
from tools.bench.cli import model_overrides

__all__ = ["placed", "variant_list", "train_config"]


def placed(variants: list) -> list:
    """The placed variants among ``variants`` (``variant_hooks.serve_placement_names``): ``--load`` with
    its experts re-placed by a checkpoint pass, not a preset."""
    names = variant_hooks.serve_placement_names()
    return [v for v in variants if v in names]


def variant_list(text: str, args=None) -> list:
    """The names of ``--variants``; a placed variant is checked against ``args`` (what it needs)."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise UserError("--variants is empty")
    if len(set(names)) != len(names):
        raise UserError(f"--variants lists a variant twice: {text}")
    placements = variant_hooks.serve_placement_names()
    for v in names:
        if v in placements:
            if args is not None:
                variant_hooks.serve_placement(v, args)  # what the placement needs is given
            continue
        if any(p in v.split("+") for p in placements):
            raise UserError(f"--variants {v}: placed variants ({', '.join(placements)}) do not combine with others")
        registry.preset_overrides(v)  # an unknown preset fails here
    return names


def train_config(args, variant: str, save: str) -> dict:
    """The flat ``pretrain_gpt`` config that trains ``variant``'s checkpoint into ``save``: the model
    of ``--config`` and the model flags, the variant's preset, bench_serve's seed and steps."""
    from megatron.components.arguments import load_yaml

    values = load_yaml(args.config) if args.config else {}
    values.update(model_overrides(args))
    values.setdefault("expert_model_parallel_size", args.ranks)
    values.setdefault("transformer_impl", "local")
    values.update(registry.preset_overrides(variant))
    for key in ("load", "tensorboard_dir", "wandb_project"):
        values.pop(key, None)
    values.update(seed=args.seed, train_iters=args.train_steps, save=save, save_interval=args.train_steps,
                  eval_interval=0, log_interval=max(1, args.train_steps // 5))
    return values
