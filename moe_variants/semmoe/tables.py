"""Scheduling tables produced by a placement method, and their on-disk format.

Shape legend: ``L`` MoE layers, ``N`` experts per layer, ``V`` vocabulary, ``D`` EP devices,
``G = D**lookback`` device-sequence contexts of the 2-gram table.

* ``expert2device`` E [L, N]: device of every expert (equal count per device).
* ``token2device`` T [L, V] and ``token2device_conf`` Tp [L, V]: predicted device of a token id and
  its confidence (by default the device with the largest share of the token's activations and
  that share; see ``solver.TokenTable``); -1 / 0 where there is no prediction.
* ``seq2device`` A [L, G] and ``seq2device_conf`` Ap [L, G]: predicted device given the devices the
  token was routed to in the previous ``lookback`` layers (App. B.1); the context index is
  ``sum_j d_{l-j} * D**(j-1)`` for j = 1..lookback (previous layer least significant). -1 / 0
  where unseen, and for the first ``lookback`` layers.

Baseline methods (contiguous, EPLB-style) carry only E; the token tables are then ``None`` and the
evaluation uses the unscheduled token assignment.

On disk a tables directory holds ``tables.npz`` (the arrays above plus ``meta_json``) and
``expert_map.json`` = ``{"physical_to_logical_map": [[...], ...]}``, [L, N]: physical slot ``s``
lives on rank ``s // (N / D)`` and hosts logical expert ``map[l][s]``. This is the mapping file
SGLang's ``--init-expert-location`` accepts, and the order in which expert weights must be
permuted so that a contiguous EP split puts every expert on its device. Both are written
atomically.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron.common.cli import user_input
from megatron.common.files import atomic_write
from moe_variants.semmoe.npz import load_npz, save_npz

__all__ = ["Tables", "save_tables", "load_tables", "TABLES_FILE", "EXPERT_MAP_FILE"]

TABLES_FORMAT = "semmoe-tables"
TABLES_VERSION = 1
TABLES_FILE = "tables.npz"
EXPERT_MAP_FILE = "expert_map.json"


@dataclass
class Tables:
    """Placement and scheduling tables for one model (module docstring for shapes)."""

    method: str
    num_devices: int
    expert2device: np.ndarray  # [L, N]
    token2device: np.ndarray | None = None  # [L, V] int16
    token2device_conf: np.ndarray | None = None  # [L, V] float32
    seq2device: np.ndarray | None = None  # [L, D**lookback] int16
    seq2device_conf: np.ndarray | None = None  # [L, D**lookback] float32
    lookback: int = 2
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.expert2device.shape[0]

    @property
    def num_experts(self) -> int:
        return self.expert2device.shape[1]

    @property
    def has_schedule(self) -> bool:
        """True when the tables carry token/sequence predictions for data scheduling."""
        return self.token2device is not None

    def physical_to_logical(self) -> np.ndarray:
        """[L, N] logical expert in each physical slot: slots grouped by device, ids ascending."""
        n = self.num_experts
        return np.argsort(self.expert2device.astype(np.int64) * n + np.arange(n), axis=1, kind="stable")

    def validate(self) -> None:
        """Raise ``ValueError`` on inconsistent shapes or an unbalanced placement."""
        e, d = self.expert2device, self.num_devices
        problems = []
        if e.ndim != 2:
            problems.append(f"expert2device must be [L, N], got shape {e.shape}")
        elif d < 1 or e.shape[1] % d:
            problems.append(f"{e.shape[1]} experts cannot be split evenly over {d} devices")
        elif e.min() < 0 or e.max() >= d:
            problems.append("expert2device values outside [0, num_devices)")
        else:
            per = np.stack([np.bincount(row, minlength=d) for row in e])
            if np.any(per != e.shape[1] // d):
                problems.append("every device must own the same number of experts")
        if self.token2device is not None:
            if self.token2device_conf is None or self.token2device.shape != self.token2device_conf.shape:
                problems.append("token2device and token2device_conf must have the same shape")
            elif self.token2device.ndim != 2 or self.token2device.shape[0] != e.shape[0]:
                problems.append("token2device must be [L, V]")
            ctx = d**self.lookback
            if self.seq2device is None or self.seq2device_conf is None:
                problems.append("scheduled tables need seq2device and seq2device_conf")
            elif self.seq2device.shape != (e.shape[0], ctx) or self.seq2device_conf.shape != (e.shape[0], ctx):
                problems.append(f"seq2device must be [L, D**lookback] = [{e.shape[0]}, {ctx}]")
        if problems:
            raise ValueError("invalid tables: " + "; ".join(problems))


def save_tables(tables: Tables, directory: str | os.PathLike) -> Path:
    """Write ``tables.npz`` and ``expert_map.json`` into ``directory`` (created if needed)."""
    tables.validate()
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory}: exists and is not a directory (tables are written to a directory)")
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {"expert2device": tables.expert2device.astype(np.int32)}
    if tables.has_schedule:
        arrays.update(
            token2device=tables.token2device.astype(np.int16),
            token2device_conf=tables.token2device_conf.astype(np.float32),
            seq2device=tables.seq2device.astype(np.int16),
            seq2device_conf=tables.seq2device_conf.astype(np.float32),
        )
    meta = {
        "format": TABLES_FORMAT,
        "version": TABLES_VERSION,
        "method": tables.method,
        "num_devices": tables.num_devices,
        "lookback": tables.lookback,
        "user": tables.meta,
    }
    save_npz(directory / TABLES_FILE, arrays, meta)
    expert_map = {"physical_to_logical_map": tables.physical_to_logical().tolist()}
    atomic_write(directory / EXPERT_MAP_FILE, lambda f: json.dump(expert_map, f), mode="w")
    return directory


@user_input()
def load_tables(directory: str | os.PathLike) -> Tables:
    """Read a tables directory; a missing or corrupt one is a one-line ``UserError``."""
    directory = Path(directory)
    path = directory / TABLES_FILE if directory.is_dir() else directory
    a, meta = load_npz(path, TABLES_FORMAT, ("expert2device",))
    if meta.get("version") != TABLES_VERSION:
        raise ValueError(f"{path}: unsupported tables version {meta.get('version')} (expected {TABLES_VERSION})")
    try:
        t = Tables(
            method=str(meta["method"]),
            num_devices=int(meta["num_devices"]),
            expert2device=a["expert2device"].astype(np.int64),
            token2device=a.get("token2device"),
            token2device_conf=a.get("token2device_conf"),
            seq2device=a.get("seq2device"),
            seq2device_conf=a.get("seq2device_conf"),
            lookback=int(meta["lookback"]),
            meta=dict(meta.get("user", {})),
        )
        t.validate()
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}: corrupt tables file ({str(e).splitlines()[0]})") from None
    return t
