"""Sem-MoE as a registered variant (its model side; the benchmarks' side is ``tools/semmoe/variant_tools.py``).

The placement itself is applied to a checkpoint by a pass (``python -m tools.semmoe apply``): it
permutes experts and router rows, so the built model needs no change and the variant has no config
section. What the variant adds is for the inference-side applications (evaluate_lm, the server):
``--semmoe-tables DIR`` assigns requests to data-parallel ranks by Algorithm 2 (TP = 1), or with
attention tensor parallelism (TP = EP = the tables' devices) re-batches the tokens of every MoE
layer by Algorithm 3 (``attention_tp``; tables without a token table, the EPLB and contiguous
baselines, give contiguous slices in that layout), after checking that the tables fit the
checkpoint (MoE layers x experts, its applied placement) and the layout.

"""

from __future__ import annotations

import os

from megatron.common.cli import UserError, user_input
from moe_variants.registry import Application, Variant, register


@register
class SemMoE(Variant):
    name = "semmoe"

    def enabled(self, model) -> bool:
        return False  # nothing to change in a built model: the placement is in the weights

    def add_runtime_arguments(self, parser) -> None:
        parser.add_argument(
            "--semmoe-tables", metavar="DIR", default=None,
            help="Sem-MoE tables (python -m tools.semmoe solve) of the checkpoint's placement: requests go to "
                 "data-parallel ranks by Algorithm 2 (EP = world = the tables' devices, TP = 1), or, with TP = EP = "
                 "the tables' devices, every MoE layer's tokens are re-batched by Algorithm 3",
        )

    @user_input()
    def _tables(self, args, manifest: dict, world_size: int):
        """The checked tables of ``--semmoe-tables``, or None (``UserError``)."""
        path = getattr(args, "semmoe_tables", None)
        if path is None:
            return None
        from moe_variants.semmoe.placement import check_tables_match_checkpoint, moe_shape
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
        tp, ep = getattr(args, "tensor_model_parallel_size", 1), args.expert_model_parallel_size
        attention_dp = tp == 1 and ep == d and world_size == d
        attention_tp = tp == d and ep == d and world_size % d == 0
        if not (attention_dp or attention_tp):
            raise ValueError(f"--semmoe-tables are for {d} devices: run with {d} ranks, --expert-model-parallel-size "
                             f"{d} and --tensor-model-parallel-size 1 (Algorithm 2, attention data-parallel), or "
                             f"--tensor-model-parallel-size {d} --expert-model-parallel-size {d} (Algorithm 3, "
                             f"attention tensor-parallel) (got {world_size} ranks, EP {ep}, TP {tp})")
        check_tables_match_checkpoint(tables, manifest, path, args.load, flag="--semmoe-tables")
        if not tables.has_schedule and attention_dp:  # Algorithm 3's layout takes them as contiguous slices
            raise ValueError(f"{flag}: tables of method {tables.method!r} carry no token table to schedule "
                             "requests with (solve with --method semmoe)")
        return tables

    def check_runtime(self, args, application: Application) -> None:
        tp = getattr(args, "tensor_model_parallel_size", 1)
        if getattr(args, "semmoe_tables", None) and tp > 1 and application == Application.EVALUATE_LM:
            raise ValueError("--semmoe-tables: evaluate_lm schedules requests by Algorithm 2 (attention "
                             "data-parallel, --tensor-model-parallel-size 1)")

    def request_scheduler(self, args, manifest: dict, world_size: int):
        """Algorithm 2 (attention data-parallel: TP = 1)."""
        tables = self._tables(args, manifest, world_size)
        if tables is None or getattr(args, "tensor_model_parallel_size", 1) != 1:
            return None
        from moe_variants.semmoe.scheduling import request_scheduler

        return request_scheduler(tables, args.semmoe_tables)

    def serving_model(self, args, manifest: dict, model, pg_collection):
        """Algorithm 3 (attention tensor-parallel: TP = EP = the tables' devices) in the served model."""
        if getattr(args, "tensor_model_parallel_size", 1) == 1:
            return None
        import torch.distributed as dist

        tables = self._tables(args, manifest, dist.get_world_size())
        if tables is None:
            return None
        if dist.get_process_group_ranks(pg_collection.tp) != dist.get_process_group_ranks(pg_collection.ep):
            raise UserError("--semmoe-tables with tensor parallelism: Algorithm 3 needs each TP group to be an "
                            "EP group (--tensor-model-parallel-size = --expert-model-parallel-size)")
        from moe_variants.semmoe.attention_tp import install

        return install(model, tables, pg_collection.tp)
