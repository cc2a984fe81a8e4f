"""Sem-MoE as a registered variant.

The placement itself is applied to a checkpoint by a pass (``python -m tools.semmoe apply``): it
permutes experts and router rows, so the built model needs no change and the variant has no config
section. What the variant adds is for the inference-side applications (evaluate_lm, the server):
``--semmoe-tables DIR`` assigns requests to data-parallel ranks by Algorithm 2, after checking that
the tables fit the checkpoint (MoE layers x experts, its applied placement) and the layout.
"""

from __future__ import annotations

import os

from moe_variants.registry import Variant, register


@register
class SemMoE(Variant):
    name = "semmoe"

    def enabled(self, model) -> bool:
        return False  # nothing to change in a built model: the placement is in the weights

    def add_runtime_arguments(self, parser) -> None:
        parser.add_argument(
            "--semmoe-tables", metavar="DIR", default=None,
            help="Sem-MoE tables (python -m tools.semmoe solve) of the checkpoint's placement: requests go to "
                 "data-parallel ranks by Algorithm 2 (EP = world = the tables' devices, TP = 1)",
        )

    def request_scheduler(self, args, manifest: dict, world_size: int):
        path = getattr(args, "semmoe_tables", None)
        if path is None:
            return None
        from moe_variants.semmoe.placement import check_tables_match_checkpoint, moe_shape
        from moe_variants.semmoe.scheduling import request_scheduler
        from moe_variants.semmoe.tables import load_tables

        flag = f"--semmoe-tables {path}"
        if not os.path.isdir(path):
            raise ValueError(f"{flag}: no such directory")
        try:
            tables = load_tables(path)
        except ValueError as err:
            raise ValueError(f"{flag}: {str(err).splitlines()[0]}") from None
        layers, experts = moe_shape(manifest, args.load)
        if (tables.num_layers, tables.num_experts) != (layers, experts):
            raise ValueError(f"{flag}: tables for {tables.num_layers} MoE layers x {tables.num_experts} experts, "
                             f"the model of --load has {layers} x {experts}")
        d = tables.num_devices
        tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
        if tp != 1 or ep != d or world_size != d:
            raise ValueError(f"--semmoe-tables are for {d} devices: run with {d} ranks, "
                             f"--expert-model-parallel-size {d} and --tensor-model-parallel-size 1 "
                             f"(got {world_size} ranks, EP {ep}, TP {tp})")
        check_tables_match_checkpoint(tables, manifest, path, args.load, flag="--semmoe-tables")
        if not tables.has_schedule:
            raise ValueError(f"{flag}: tables of method {tables.method!r} carry no token table to schedule "
                             "requests with (solve with --method semmoe)")
        return request_scheduler(tables, path)
