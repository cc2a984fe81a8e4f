"""Expert placement on a checkpoint: permute expert weights and router rows per MoE layer.

megatron-core's EP split is contiguous: EP rank r owns experts ``[r * N/EP, (r+1) * N/EP)`` in the
order of the expert index. So a placement is realised by permuting, in the layout-free global
state dict (``moe_variants.global_state``, which names the experts of both local expert paths,
``GroupedExperts`` and ``SequentialMLP``, per expert), the experts of every MoE layer into the order of
the tables' ``physical_to_logical`` map (devices in order, experts ascending within a device)
together with the router rows (``router.weight`` [N, H], and ``router.bias`` / ``expert_bias``
[N] where present). The permuted model computes the same function: the router scores the same
experts, just under other indices, and each index still names the same expert weights. Loaded at
EP = D, rank d then owns exactly the experts the tables put on device d; loaded at another EP the
same file is split contiguously again (no local shuffle at load time).

Pure functions on dicts of tensors, plus :func:`permute_model_experts`, the in-place edge used by
the checkpoint pass (``tools/semmoe``) and the benchmark variant (``bench.py``), and the placement record a placed
checkpoint's manifest carries (``checkpoint_placement``; tables must match it to schedule requests).

Shape legend: ``L`` MoE layers, ``N`` experts per layer, ``H`` hidden.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from megatron.common.cli import UserError
from moe_variants.config import ModelConfig, moe_layer_pattern
from moe_variants.semmoe.tables import Tables

__all__ = [
    "moe_layer_prefixes",
    "permute_expert_state",
    "compose_maps",
    "permute_model_experts",
    "ROUTER_PER_EXPERT",
    "PLACEMENT_SECTION",
    "checkpoint_placement",
    "check_tables_match_checkpoint",
    "moe_shape",
    "gather_embedding",
]

# the section of a checkpoint manifest's configs that records an applied placement
PLACEMENT_SECTION = "semmoe"

_EXPERT = re.compile(r"^(?P<prefix>.+)\.experts\.local_experts\.(?P<index>\d+)\.(?P<rest>.+)$")
_GROUPED = re.compile(r"^(?P<prefix>.+)\.experts\.(weight1|weight2)$")
# router tensors whose leading dimension is the expert index (weight [N, H]; bias, expert_bias [N])
ROUTER_PER_EXPERT = ("router.weight", "router.bias", "router.expert_bias", "router.local_tokens_per_expert",
                     "router.global_tokens_per_expert")


def moe_layer_prefixes(state: Mapping[str, torch.Tensor]) -> list[str]:
    """MoE layer prefixes (``decoder.layers.{i}.mlp``) in layer order, from expert parameter names."""
    grouped = sorted({m.group("prefix") for k in state for m in [_GROUPED.match(k)] if m})
    if grouped:
        raise ValueError(
            f"{grouped[0]}: megatron-core's legacy GroupedMLP experts (weight1/weight2) cannot be permuted by "
            "this pass; use the local spec's experts (--transformer-impl local: grouped GEMM or the loop)"
        )
    prefixes = {m.group("prefix") for k in state for m in [_EXPERT.match(k)] if m}

    def layer_key(prefix: str):
        nums = [int(x) for x in re.findall(r"\d+", prefix)]
        return nums, prefix

    return sorted(prefixes, key=layer_key)


def permute_expert_state(
    state: Mapping[str, torch.Tensor], prefixes: Sequence[str], physical_to_logical: np.ndarray
) -> dict[str, torch.Tensor]:
    """Global state dict whose slot ``s`` of MoE layer ``l`` holds logical expert ``p2l[l, s]``.

    state: TP=1/EP=1-named tensors (plus any router buffers); prefixes: [L] MoE layer prefixes in
    the order of the map's rows; physical_to_logical: [L, N], each row a permutation of 0..N-1.
    Every expert tensor and every per-expert router tensor of those layers is moved; everything
    else is passed through unchanged (same tensor objects).
    """
    p2l = np.asarray(physical_to_logical, dtype=np.int64)
    if p2l.ndim != 2 or p2l.shape[0] != len(prefixes):
        raise ValueError(f"placement map has shape {p2l.shape}, the model has {len(prefixes)} MoE layers")
    n = p2l.shape[1]
    for l, row in enumerate(p2l):
        if not np.array_equal(np.sort(row), np.arange(n)):
            raise ValueError(f"placement map row {l} is not a permutation of 0..{n - 1}")
    index_of = {p: l for l, p in enumerate(prefixes)}
    experts_seen: dict[str, set[int]] = {p: set() for p in prefixes}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        m = _EXPERT.match(key)
        if m and m.group("prefix") in index_of:
            experts_seen[m.group("prefix")].add(int(m.group("index")))
            continue  # filled below from the logical experts
        prefix, _, tail = key.rpartition(".router.")
        if prefix in index_of and f"router.{tail}" in ROUTER_PER_EXPERT:
            if tensor.shape[0] != n:
                raise ValueError(f"{key}: leading dimension {tensor.shape[0]} != {n} experts")
            out[key] = tensor.index_select(0, torch.from_numpy(p2l[index_of[prefix]]).to(tensor.device))
            continue
        out[key] = tensor
    for prefix, seen in experts_seen.items():
        if seen != set(range(n)):
            raise ValueError(f"{prefix}: the state holds experts {sorted(seen)[:8]}..., expected 0..{n - 1}")
    for key, tensor in state.items():
        m = _EXPERT.match(key)
        if not (m and m.group("prefix") in index_of):
            continue
        prefix, logical, rest = m.group("prefix"), int(m.group("index")), m.group("rest")
        row = p2l[index_of[prefix]]
        slot = int(np.flatnonzero(row == logical)[0])
        out[f"{prefix}.experts.local_experts.{slot}.{rest}"] = tensor
    return out


def compose_maps(outer: np.ndarray | None, inner: np.ndarray) -> np.ndarray:
    """Placement of a checkpoint placed twice: [L, N] ``outer[l, inner[l, s]]``, the original
    expert in slot ``s`` when ``inner`` was applied to a checkpoint already placed by ``outer``
    (``None`` = unplaced)."""
    inner = np.asarray(inner, dtype=np.int64)
    if outer is None:
        return inner.copy()
    outer = np.asarray(outer, dtype=np.int64)
    if outer.shape != inner.shape:
        raise ValueError(f"placement maps of shapes {outer.shape} and {inner.shape} cannot be composed")
    return np.take_along_axis(outer, inner, axis=1)


def permute_model_experts(model, pg_collection, physical_to_logical: np.ndarray) -> None:
    """Permute a built model's experts and router rows in place (collective over its groups).

    The model may be at any TP/EP layout: its layout-free state is gathered, permuted with
    :func:`permute_expert_state` and sliced back, so rank r ends up owning the experts the map
    puts in its slots. Router buffers with a per-expert leading dimension (``expert_bias``, token
    counters) are replicated on every rank and permuted locally. Call it before DDP and the
    optimizer copy the parameters.
    """
    from moe_variants.global_state import gather_global_state_dict, load_global_state_dict

    state = gather_global_state_dict(model, pg_collection)
    buffers = {
        name: buf.detach().clone() for name, buf in model.named_buffers()
        if buf is not None and any(name.endswith("." + r) for r in ROUTER_PER_EXPERT)
    }  # fmt: skip
    prefixes = moe_layer_prefixes(state)
    if len(prefixes) != np.asarray(physical_to_logical).shape[0]:
        raise ValueError(
            f"the model has {len(prefixes)} MoE layers, the placement {np.asarray(physical_to_logical).shape[0]}"
        )
    placed = permute_expert_state({**state, **buffers}, prefixes, physical_to_logical)
    load_global_state_dict(model, {k: v for k, v in placed.items() if k not in buffers}, pg_collection)
    with torch.no_grad():
        for name in buffers:
            model.get_buffer(name).copy_(placed[name])


def checkpoint_placement(manifest: dict) -> Optional[dict]:
    """The ``semmoe`` placement record of a checkpoint's manifest, or None if it is unplaced."""
    return manifest.get("configs", {}).get(PLACEMENT_SECTION)


def moe_shape(manifest: dict, path: str) -> tuple[int, int]:
    """(MoE layers, experts) of a checkpoint's model config."""
    try:
        cfg = ModelConfig.from_dump(manifest["configs"])
        pattern = moe_layer_pattern(cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the model config ({str(e).splitlines()[0]})") from None
    if not cfg.num_experts:
        raise ValueError(f"{path}: the model has no experts (not an MoE checkpoint)")
    return int(sum(pattern)), int(cfg.num_experts)


def check_tables_match_checkpoint(tables: Tables, manifest: dict, tables_path: str, ckpt_path: str,
                                  flag: str = "--tables") -> None:
    """``UserError`` unless ``tables`` are the placement the checkpoint carries (contiguous tables match
    an unplaced checkpoint): the token tables only predict the right devices for that placement.
    ``flag`` names the tables' option in the message."""
    placement = checkpoint_placement(manifest)
    expected = tables.physical_to_logical()
    if placement is None:
        applied = np.tile(np.arange(tables.num_experts), (tables.num_layers, 1))
    else:
        applied = np.asarray(placement["semmoe_tables_map"], dtype=np.int64)
    if applied.shape != expected.shape or not np.array_equal(applied, expected):
        raise UserError(
            f"{flag} {tables_path} are not the placement of --load {ckpt_path}; "
            "apply them first (python -m tools.semmoe apply)"
        )


def gather_embedding(model, pg_collection, vocab_size: int) -> np.ndarray:
    """[V, H] float32 input embedding table (vocab-parallel shards all-gathered over TP), what a
    profile's vocabulary extension reads (collective over TP)."""
    import torch.distributed as dist

    from megatron.common import collectives

    weight = model.embedding.word_embeddings.weight.detach().float()
    tp = pg_collection.tp
    if dist.get_world_size(tp) > 1:
        parts = [torch.empty_like(weight) for _ in range(dist.get_world_size(tp))]
        collectives.all_gather(parts, weight.contiguous(), group=tp)
        weight = torch.cat(parts, 0)
    return weight[:vocab_size].cpu().numpy()
