"""``python -m tools.semmoe export-costs``: a placement's per-rank traffic beside the network's
per-EP-rank cost matrix, as one ``moe-ep-cost/1`` JSON (format: ``netsim.ep_costs``).

The cost matrix comes from ``python -m netsim ep-costs`` (``--costs``); the traffic from tables and
a held-out profile: every activation's token device (``--mode``: attention-DP, Algorithm 2 or
round-robin; attention-TP, Algorithm 3 or contiguous slices, as ``evaluate``) and its expert's
device, counted per pair of ranks over all MoE layers and turned into dispatch bytes per token
(hidden x bytes per element). ``sum(traffic)`` is ``evaluate``'s all-to-all bytes per token.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from megatron.common.cli import UserError, positive_int, user_input

from .commands import command


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", required=True, help="moe-ep-cost/1 JSON of the network (python -m netsim ep-costs)")
    p.add_argument("--tables", required=True, help="tables directory (python -m tools.semmoe solve)")
    p.add_argument("--profile", required=True, help="held-out profile .npz the traffic is counted on")
    p.add_argument("--mode", choices=["dp", "tp"], default="dp", help="attention deployment mode")
    p.add_argument("--hidden-size", type=positive_int, default=None, help="default: the profile's meta hidden_size")
    p.add_argument("--bytes-per-element", type=positive_int, default=2, help="activation element size (bf16: 2)")
    p.add_argument("--tp-batch-tokens", type=int, default=0, help="TP mode batches (0: one request per batch)")
    p.add_argument("--out", required=True, help="moe-ep-cost/1 JSON to write (with traffic)")


@command("export-costs", "per-EP-rank cost matrix and a placement's traffic as moe-ep-cost/1 JSON", _configure)
def _export_costs(args: argparse.Namespace) -> int:
    from moe_variants.semmoe.metrics import rank_traffic
    from moe_variants.semmoe.profile import load_profile
    from moe_variants.semmoe.tables import load_tables
    from netsim.ep_costs import read_cost_document, with_traffic, write_cost_document

    with user_input():
        doc = read_cost_document(args.costs)
        tables = load_tables(args.tables)
    if doc["num_ranks"] != tables.num_devices:
        raise UserError(f"--costs {args.costs} is for {doc['num_ranks']} EP ranks, --tables {args.tables} for "
                         f"{tables.num_devices} devices")
    with user_input():
        profile = load_profile(args.profile)
    hidden = args.hidden_size or profile.meta.get("hidden_size")
    if not hidden:
        raise UserError("--hidden-size is required: the profile does not record the model's hidden size")
    pairs, source_expert = rank_traffic(tables, profile, args.mode, args.tp_batch_tokens)
    per_token = float(hidden) * args.bytes_per_element / profile.num_tokens
    total = pairs.sum(0)
    source = {
        "placement": tables.method, "tables": os.path.abspath(args.tables), "profile": os.path.abspath(args.profile),
        "mode": args.mode, "scheduled": tables.has_schedule, "tp_batch_tokens": args.tp_batch_tokens,
        "hidden_size": int(hidden), "bytes_per_element": args.bytes_per_element,
        "num_tokens": profile.num_tokens, "num_layers": profile.num_layers,
    }  # fmt: skip
    out = with_traffic(doc, total * per_token, np.diagonal(total) * per_token,
                       source_expert.transpose(1, 0, 2) / profile.num_tokens, source)  # fmt: skip
    write_cost_document(out, args.out)
    sent = float(np.sum(out["traffic"]))
    print(f"{tables.method} ({args.mode}) on {doc['network']['topology']}: {sent:,.0f} dispatch bytes/token off-rank, "
          f"{out['link_seconds_per_token'] * 1e9:.3f} ns of link time per token -> {args.out}")
    return 0
