"""Evaluate a placement (and its scheduling tables) on a held-out profile.

Metrics (paper §4.5-4.6):

* LAR, local activation rate: token-expert activations computed on the token's own device /
  all activations; reported globally and as p25/p50/p75 over requests (Table 3 uses p50).
* load imbalance: max / median of the per-device expert load (activations its experts compute),
  per layer; mean and max over layers. ``peak_to_mean`` is the same with max / mean.
* predicted all-to-all bytes: remote activations x hidden x bytes per element (one direction,
  the dispatch; the combine moves the same amount back), as this stack's dispatcher sends every
  (token, expert) pair. ``remote_sends`` counts instead, per token and layer, the distinct other
  devices among its experts' devices: what a dispatcher that sends a token once per destination
  device (DeepEP's) moves, which co-locating co-activated experts lowers.

A token's device follows the deployment mode. ``DP`` (attention data parallel): whole requests
sit on one rank; scheduled tables use Algorithm 2 in arrival order, baselines round-robin.
``TP`` (attention tensor parallel): each batch's tokens are reduce-scattered before every MoE
layer; scheduled tables re-batch them with Algorithm 3 (the same torch functions serving uses),
baselines keep the natural contiguous slices. A batch is one request, or consecutive requests
packed up to ``tp_batch_tokens``.

Shape legend: ``L`` layers, ``R`` requests, ``S`` occurrences, ``K`` top-k, ``D`` devices.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass

import numpy as np
import torch

from megatron.common.cli import UserError

from .profile import Profile
from .scheduling import align_to_ranks, predict_token_devices, routed_devices, schedule_requests
from .tables import Tables

__all__ = [
    "DeploymentMode", "EvalResult", "evaluate", "token_devices", "token_devices_dp", "token_devices_tp", "tp_batches",
    "rank_traffic",
]  # fmt: skip


class DeploymentMode(str, enum.Enum):
    DP = "dp"
    TP = "tp"


@dataclass
class EvalResult:
    method: str
    mode: str
    num_devices: int
    scheduled: bool
    lar: float
    lar_p25: float
    lar_p50: float
    lar_p75: float
    imbalance_mean: float
    imbalance_max: float
    peak_to_mean: float
    peak_to_mean_max: float
    total_activations: int
    remote_activations: int
    remote_sends: int
    a2a_bytes: float | None
    a2a_bytes_per_device: float | None
    tp_batch_tokens: int
    lar_per_layer: list[float]
    by_group: dict[str, dict] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _check_compatible(tables: Tables, profile: Profile) -> None:
    if tables.expert2device.shape != (profile.num_layers, profile.num_experts):
        raise UserError(
            f"tables are for {tables.num_layers} layers x {tables.num_experts} experts, the profile has "
            f"{profile.num_layers} x {profile.num_experts}"
        )
    if tables.has_schedule and tables.token2device.shape[1] != profile.vocab_size:
        raise UserError(
            f"tables cover a vocabulary of {tables.token2device.shape[1]}, the profile {profile.vocab_size}"
        )


def token_devices_dp(tables: Tables, profile: Profile) -> np.ndarray:
    """[R] rank of each request: Algorithm 2 for scheduled tables, round-robin otherwise."""
    if not tables.has_schedule:
        return np.arange(profile.num_requests) % tables.num_devices
    offs = profile.request_offsets
    requests = [profile.token_ids[offs[i] : offs[i + 1]] for i in range(profile.num_requests)]
    return schedule_requests(requests, tables)


def tp_batches(request_lengths: np.ndarray, batch_tokens: int) -> np.ndarray:
    """[B] token counts of the TP batches formed by packing consecutive whole requests up to
    ``batch_tokens`` tokens (a longer request forms its own batch); 0 = one request per batch."""
    if batch_tokens <= 0:
        return np.asarray(request_lengths, dtype=np.int64)
    batches, current = [], 0
    for n in request_lengths:
        if current and current + n > batch_tokens:
            batches.append(current)
            current = 0
        current += int(n)
    batches.append(current)
    return np.array(batches, dtype=np.int64)


def token_devices_tp(tables: Tables, profile: Profile, batch_tokens: int = 0) -> np.ndarray:
    """[L, S] device of every occurrence before each MoE layer: Algorithm 3 (predict from T/A, align
    per TP batch) for scheduled tables, the natural reduce-scatter slices otherwise. Batches are
    formed by :func:`tp_batches`."""
    d = tables.num_devices
    lengths = torch.from_numpy(tp_batches(profile.request_lengths(), batch_tokens))
    out = np.empty((profile.num_layers, profile.num_tokens), dtype=np.int64)
    none = torch.full((profile.num_tokens,), -1, dtype=torch.long)
    zero = torch.zeros(profile.num_tokens)
    if not tables.has_schedule:
        out[:] = align_to_ranks(none, zero, d, lengths).numpy()
        return out
    tokens = torch.from_numpy(profile.token_ids.astype(np.int64))
    history: list[torch.Tensor] = []  # routed devices of previous layers, most recent first
    for l in range(profile.num_layers):
        use_seq = l >= tables.lookback
        pred, conf = predict_token_devices(
            tokens,
            d,
            torch.from_numpy(tables.token2device[l].astype(np.int64)),
            torch.from_numpy(tables.token2device_conf[l].astype(np.float32)),
            torch.from_numpy(tables.seq2device[l].astype(np.int64)) if use_seq else None,
            torch.from_numpy(tables.seq2device_conf[l].astype(np.float32)) if use_seq else None,
            torch.stack(history[: tables.lookback], dim=1) if use_seq else None,
        )
        out[l] = align_to_ranks(pred, conf, d, lengths).numpy()
        e2d = torch.from_numpy(tables.expert2device[l].astype(np.int64))
        history.insert(0, routed_devices(torch.from_numpy(profile.routes[l].astype(np.int64)), e2d))
        del history[tables.lookback :]
    return out


def token_devices(tables: Tables, profile: Profile, mode: DeploymentMode | str, tp_batch_tokens: int = 0) -> np.ndarray:
    """[L, S] device of every occurrence before each MoE layer in deployment ``mode``."""
    if DeploymentMode(mode) is DeploymentMode.DP:
        req_dev = token_devices_dp(tables, profile)
        return np.broadcast_to(np.repeat(req_dev, profile.request_lengths()), (profile.num_layers, profile.num_tokens))
    return token_devices_tp(tables, profile, tp_batch_tokens)


def rank_traffic(
    tables: Tables, profile: Profile, mode: DeploymentMode | str, tp_batch_tokens: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Who sends what to whom. Returns pairs [L, D, D] int64 (activations whose token sits on device
    i and whose expert on device j, the dispatch direction; the diagonal stays local) and
    source_expert [L, D, N] int64 (activations of expert e by tokens on device s)."""
    _check_compatible(tables, profile)
    d, n = tables.num_devices, profile.num_experts
    occ_dev = token_devices(tables, profile, mode, tp_batch_tokens)
    pairs = np.empty((profile.num_layers, d, d), dtype=np.int64)
    source_expert = np.empty((profile.num_layers, d, n), dtype=np.int64)
    for l in range(profile.num_layers):
        routes = profile.routes[l].astype(np.int64)
        src = np.broadcast_to(occ_dev[l][:, None], routes.shape)
        dst = tables.expert2device[l][routes]
        pairs[l] = np.bincount((src * d + dst).ravel(), minlength=d * d).reshape(d, d)
        source_expert[l] = np.bincount((src * n + routes).ravel(), minlength=d * n).reshape(d, n)
    return pairs, source_expert


def evaluate(
    tables: Tables,
    profile: Profile,
    mode: DeploymentMode | str,
    hidden_size: int | None = None,
    bytes_per_element: int = 2,
    tp_batch_tokens: int = 0,
    groups: dict[str, np.ndarray] | None = None,
) -> EvalResult:
    """LAR, imbalance and predicted all-to-all bytes of ``tables`` on the held-out ``profile``.

    ``tp_batch_tokens`` sets the TP batch (see :func:`tp_batches`); the equal-slice constraint
    of Algorithm 3 binds hardest with one request per batch, since a request's tokens often
    prefer the same device.

    ``groups`` (name -> request indices, e.g. one per domain) adds, per group, the LAR and
    imbalance of its own requests when served together with all the others (the devices are
    chosen over the whole profile, as a server that mixes domains would)."""
    mode = DeploymentMode(mode)
    _check_compatible(tables, profile)
    d, num_layers, k = tables.num_devices, profile.num_layers, profile.top_k
    lengths = profile.request_lengths()
    starts = profile.request_offsets[:-1]
    occ_dev = token_devices(tables, profile, mode, tp_batch_tokens)

    groups = {name: np.asarray(idx, dtype=np.int64) for name, idx in (groups or {}).items()}
    occ_group = {name: np.isin(profile.request_of_token(), idx) for name, idx in groups.items()}
    local_req = np.zeros(profile.num_requests)
    lar_layer, imbalance, peak = [], [], []
    sends = 0
    group_imbalance = {name: [] for name in groups}
    for l in range(num_layers):
        exp_dev = tables.expert2device[l][profile.routes[l]]  # [S, K]
        local = (exp_dev == occ_dev[l][:, None]).sum(1)
        local_req += np.add.reduceat(local, starts)
        lar_layer.append(float(local.sum()) / (profile.num_tokens * k))
        imbalance.append(_imbalance(exp_dev, d))
        load = np.bincount(exp_dev.ravel(), minlength=d)
        peak.append(float(load.max() / load.mean()))
        sends += _remote_devices(exp_dev, occ_dev[l], d)
        for name, mask in occ_group.items():
            group_imbalance[name].append(_imbalance(exp_dev[mask], d))
    lar_req = local_req / (lengths * k * num_layers)
    by_group = None
    if groups:
        by_group = {}
        for name, idx in groups.items():
            if len(idx) == 0:
                raise ValueError(f"group {name!r} has no requests")
            g25, g50, g75 = np.percentile(lar_req[idx], [25, 50, 75])
            by_group[name] = {
                "requests": int(len(idx)), "tokens": int(lengths[idx].sum()),
                "lar": float(local_req[idx].sum() / (lengths[idx].sum() * k * num_layers)),
                "lar_p25": float(g25), "lar_p50": float(g50), "lar_p75": float(g75),
                "imbalance_mean": float(np.mean(group_imbalance[name])),
                "imbalance_max": float(np.max(group_imbalance[name])),
            }  # fmt: skip
    total = profile.num_tokens * k * num_layers
    local_total = int(round(local_req.sum()))
    remote = total - local_total
    p25, p50, p75 = np.percentile(lar_req, [25, 50, 75])
    return EvalResult(
        method=tables.method,
        mode=mode.value,
        num_devices=d,
        scheduled=tables.has_schedule,
        lar=local_total / total,
        lar_p25=float(p25),
        lar_p50=float(p50),
        lar_p75=float(p75),
        imbalance_mean=float(np.mean(imbalance)),
        imbalance_max=float(np.max(imbalance)),
        peak_to_mean=float(np.mean(peak)),
        peak_to_mean_max=float(np.max(peak)),
        total_activations=int(total),
        remote_activations=int(remote),
        remote_sends=int(sends),
        a2a_bytes=float(remote) * hidden_size * bytes_per_element if hidden_size else None,
        a2a_bytes_per_device=float(sends) * hidden_size * bytes_per_element if hidden_size else None,
        tp_batch_tokens=tp_batch_tokens if mode is DeploymentMode.TP else 0,
        lar_per_layer=lar_layer,
        by_group=by_group,
    )


def _remote_devices(exp_dev: np.ndarray, token_dev: np.ndarray, num_devices: int) -> int:
    """Sum over occurrences of the distinct devices other than the token's among its experts'
    devices. exp_dev: [S, K]; token_dev: [S]."""
    hit = np.zeros((len(token_dev), num_devices), dtype=bool)
    hit[np.arange(len(token_dev))[:, None], exp_dev] = True
    hit[np.arange(len(token_dev)), token_dev] = False
    return int(hit.sum())


def _imbalance(exp_dev: np.ndarray, num_devices: int) -> float:
    """max / median of the activations each device's experts compute (inf if the median is 0)."""
    load = np.bincount(exp_dev.ravel(), minlength=num_devices)
    med = float(np.median(load))
    return float(load.max()) / med if med > 0 else float("inf")
