"""Per-EP-rank communication costs of a network, and the ``moe-ep-cost/1`` JSON document.

A topology-aware expert placement needs what one byte from EP rank i to EP rank j costs. From the
collective model's networks (:mod:`netsim.collectives`), for ranks ``0..D-1`` sitting on XPUs
``0..D-1`` (torus and full-mesh: the group's sub-block of :func:`~netsim.collectives.group_dims`,
first dimension fastest; scale-out: node ``r // gpus_per_node``):

* ``hops[i][j]``: links on the route. Switched networks (scale-up, a flat switch, scale-out) count
  the sender's and the receiver's port (2; scale-out: NVLink inside a node, NICs across nodes);
  a torus the dimension-order route's hops (shortest way round where the group spans a dimension,
  along the line otherwise); a full-mesh one link per dimension in which the coordinates differ.
* ``cost[i][j]``: the link-seconds one byte occupies, the sum over the route's links of
  ``1 / (link bandwidth x the tier's utilisation)`` (s/byte). Summed against a traffic matrix it
  is the link time a placement's all-to-all costs: farther ranks cost more on a torus, other
  nodes more on scale-out, and every pair the same on a single switch.
* ``latency[i][j]``: the tier's per-destination latency ``alpha_dest`` (s).

All three are square, non-negative and zero on the diagonal (a rank's own tokens do not travel).

The document (``SCHEMA``; :func:`cost_document` builds it, :func:`check_cost_document` checks it):

==========================  ================  ===================================================
``schema``                  str               ``"moe-ep-cost/1"``
``num_ranks``               int D             EP ranks; rows and columns in EP rank order
``units``                   dict              ``{"cost": "s/byte", "latency": "s", "hops": "links"}``
                                              (+ ``"traffic": "bytes/token"`` with traffic)
``network``                 dict              topology, XPUs, bandwidths (GB/s), dims, constants
``cost``, ``latency``       [D][D] float      as above
``hops``                    [D][D] int        as above
``traffic`` (optional)      [D][D] float      dispatch bytes from rank i to rank j per token, all
                                              MoE layers (diagonal 0; the combine is the transpose)
``local_bytes_per_token``   [D] float         with traffic: bytes that stayed on their rank
``source_expert``           [D][L][N] float   with traffic: activations of expert e in layer l by
                                              tokens on rank s, per token (SGLang's
                                              ``[source, layer, expert]`` statistics)
``link_seconds_per_token``  float             with traffic: ``sum(traffic * cost)``
``traffic_source``          dict              with traffic: placement, profile, deployment mode
==========================  ================  ===================================================
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .collectives import GB, Network, Topology, group_dims

__all__ = [
    "SCHEMA", "RankCosts", "rank_costs", "cost_document", "with_traffic", "check_cost_document", "read_cost_document",
    "write_cost_document",
]  # fmt: skip

SCHEMA = "moe-ep-cost/1"
_REQUIRED = ("schema", "num_ranks", "units", "network", "cost", "latency", "hops")
_WITH_TRAFFIC = ("traffic", "local_bytes_per_token", "source_expert", "link_seconds_per_token", "traffic_source")


@dataclass(frozen=True)
class RankCosts:
    """[D, D] matrices of :func:`rank_costs` (module docstring)."""

    cost: np.ndarray  # s/byte
    latency: np.ndarray  # s
    hops: np.ndarray  # links


def _coordinates(dims, num_ranks: int) -> tuple[np.ndarray, tuple[int, ...], tuple[bool, ...]]:
    """[D, len(dims)] coordinates of the ranks in the group's sub-block, its extent and wrap flags."""
    t, spans = group_dims(dims, num_ranks)
    r = np.arange(num_ranks)
    stride = np.cumprod((1,) + t[:-1])
    return (r[:, None] // stride[None, :]) % np.array(t)[None, :], t, spans


def rank_costs(network: Network, num_ranks: int) -> RankCosts:
    """Route costs between the first ``num_ranks`` XPUs of ``network`` (module docstring)."""
    d = int(num_ranks)
    if not 1 <= d <= network.num_xpus:
        raise ValueError(f"{d} EP ranks do not fit a network of {network.num_xpus} XPUs")
    topo, c = network.topology, network.constants
    off = ~np.eye(d, dtype=bool)
    if topo in (Topology.SCALE_UP, Topology.SWITCH):
        hops = 2 * off.astype(np.int64)
        per_link = np.full((d, d), 1.0 / (network.bandwidth * c.utilization))
        latency = np.full((d, d), c.alpha_dest)
    elif topo == Topology.SCALE_OUT:
        node = np.arange(d) // network.gpus_per_node
        same = node[:, None] == node[None, :]
        inter = network.inter_constants
        hops = 2 * off.astype(np.int64)
        per_link = np.where(same, 1.0 / (network.node_bandwidth * c.utilization),
                            1.0 / (network.bandwidth * inter.utilization))  # fmt: skip
        latency = np.where(same, c.alpha_dest, inter.alpha_dest)
    else:
        coords, t, spans = _coordinates(network.dims, d)
        delta = np.abs(coords[:, None, :] - coords[None, :, :])  # [D, D, dims]
        if topo == Topology.TORUS_3D:
            size = np.array(t)
            wrap = np.array(spans) & (size > 2)
            hops = np.where(wrap, np.minimum(delta, size - delta), delta).sum(-1)
        else:  # full-mesh: one direct link per differing dimension
            hops = (delta > 0).sum(-1)
        per_link = np.full((d, d), 1.0 / (network.link_bandwidth * c.utilization))
        latency = np.full((d, d), c.alpha_dest)
    hops = np.where(off, hops, 0).astype(np.int64)
    return RankCosts(cost=hops * per_link, latency=np.where(off, latency, 0.0), hops=hops)


def _network_record(network: Network) -> dict:
    return {
        "topology": network.topology.value, "num_xpus": network.num_xpus,
        "bandwidth_gbps": network.bandwidth / GB, "link_bandwidth_gbps": network.link_bandwidth / GB,
        "dims": list(network.dims), "gpus_per_node": network.gpus_per_node,
        "node_bandwidth_gbps": network.node_bandwidth / GB,
        "constants": network.constants.as_dict(), "inter_constants": network.inter_constants.as_dict(),
    }  # fmt: skip


def cost_document(network: Network, num_ranks: int) -> dict:
    """The ``moe-ep-cost/1`` document of ``network``'s first ``num_ranks`` XPUs, without traffic
    (:func:`with_traffic` adds it)."""
    rc = rank_costs(network, num_ranks)
    return {
        "schema": SCHEMA, "num_ranks": int(num_ranks),
        "units": {"cost": "s/byte", "latency": "s", "hops": "links"},
        "network": _network_record(network),
        "cost": rc.cost.tolist(), "latency": rc.latency.tolist(), "hops": rc.hops.tolist(),
    }  # fmt: skip


def with_traffic(doc: dict, traffic: np.ndarray, local: np.ndarray, source_expert: np.ndarray, source: dict) -> dict:
    """``doc`` with a placement's traffic: traffic [D, D] dispatch bytes per token (diagonal
    ignored), local [D] bytes per token kept on each rank, source_expert [D, L, N] activations per
    token, ``source`` what they were measured on."""
    traffic = np.array(traffic, dtype=np.float64)
    np.fill_diagonal(traffic, 0.0)
    out = dict(doc)
    out["units"] = {**doc["units"], "traffic": "bytes/token", "source_expert": "activations/token"}
    out.update(
        traffic=traffic.tolist(),
        local_bytes_per_token=np.asarray(local, dtype=np.float64).tolist(),
        source_expert=np.asarray(source_expert, dtype=np.float64).tolist(),
        link_seconds_per_token=float((traffic * np.asarray(doc["cost"])).sum()),
        traffic_source=source,
    )
    check_cost_document(out)
    return out


def _matrix(doc: dict, key: str, d: int, integer: bool = False) -> np.ndarray:
    try:
        m = np.array(doc[key], dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: not a matrix of numbers") from None
    if m.shape != (d, d):
        raise ValueError(f"{key}: expected a {d} x {d} matrix (num_ranks), got shape {m.shape}")
    if not np.isfinite(m).all() or (m < 0).any():
        raise ValueError(f"{key}: entries must be finite and non-negative")
    if np.any(np.diagonal(m) != 0):
        raise ValueError(f"{key}: the diagonal must be zero")
    if integer and np.any(m != np.round(m)):
        raise ValueError(f"{key}: entries must be integers")
    return m


def check_cost_document(doc: Any) -> None:
    """Raise ``ValueError`` naming the first problem of a ``moe-ep-cost/1`` document."""
    if not isinstance(doc, dict):
        raise ValueError("a moe-ep-cost document is a JSON object")
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise ValueError(f"missing key(s): {', '.join(missing)}")
    if doc["schema"] != SCHEMA:
        raise ValueError(f"schema: expected {SCHEMA!r}, got {doc['schema']!r}")
    d = doc["num_ranks"]
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise ValueError(f"num_ranks: expected a positive integer, got {d!r}")
    for key in ("cost", "latency", "hops"):
        _matrix(doc, key, d, integer=key == "hops")
    present = [k for k in _WITH_TRAFFIC if k in doc]
    if not present:
        return
    if len(present) != len(_WITH_TRAFFIC):
        raise ValueError(f"traffic: keys {', '.join(sorted(set(_WITH_TRAFFIC) - set(present)))} are missing")
    traffic = _matrix(doc, "traffic", d)
    local = np.array(doc["local_bytes_per_token"], dtype=np.float64)
    if local.shape != (d,) or not np.isfinite(local).all() or (local < 0).any():
        raise ValueError(f"local_bytes_per_token: expected {d} finite non-negative numbers")
    se = np.array(doc["source_expert"], dtype=np.float64)
    if se.ndim != 3 or se.shape[0] != d or not np.isfinite(se).all() or (se < 0).any():
        raise ValueError(f"source_expert: expected a [{d}][L][N] array of finite non-negative numbers")
    expected = float((traffic * np.array(doc["cost"], dtype=np.float64)).sum())
    if not math.isclose(doc["link_seconds_per_token"], expected, rel_tol=1e-9, abs_tol=1e-30):
        raise ValueError(f"link_seconds_per_token: {doc['link_seconds_per_token']} != sum(traffic * cost) = {expected}")


def read_cost_document(path: str | Path) -> dict:
    """Read and check a ``moe-ep-cost/1`` file; problems are one-line ``ValueError``s naming it."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        doc = json.loads(p.read_text())
        check_cost_document(doc)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return doc


def write_cost_document(doc: dict, path: str | Path, indent: Optional[int] = 1) -> Path:
    """Check ``doc`` and write it atomically."""
    from megatron.common.files import write_json

    check_cost_document(doc)
    return write_json(path, doc, indent=indent)
