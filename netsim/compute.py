"""Per-layer compute times from a profile table (paper §3.2.3), and roofline estimates/projections.

A :class:`ProfileTable` holds, for every :class:`~netsim.model.LayerKind`, the seconds one GPU
spends on that kind over a grid of its axes (tokens, TP size, context length, ...), plus each grid
point's FLOPs and bytes. Times between grid points are interpolated linearly (below the grid: the
smallest point; above: linear extrapolation, which is how a saturated kernel grows).

Where the times come from is the table's ``provenance``:
* ``scripts/profile_netsim_compute.py`` measures them on a user's GPU (CUDA graphs, as in the
  paper's Vidur-style single-GPU profiling) and writes ``method: measured``;
* :func:`roofline_table` estimates them from public specifications (``method: roofline-estimate``).
  The shipped default (``netsim/data/h100_roofline.json``) is such an estimate for the H100 SXM:
  no GPU was available to us. Its efficiencies are assumptions (:class:`RooflineEfficiency`).

:func:`project_table` moves any table to another GPU generation (paper §4.5, Table 5): each grid
point's time is divided by its roofline speedup ``roof(source) / roof(target)``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Mapping, Optional

import numpy as np
from scipy.interpolate import RegularGridInterpolator

from megatron.common.files import write_json
from .model import DEEPSEEK_V3, KIND_AXES, LayerKind, ModelShape, Roof, kernel_work

__all__ = [
    "GpuSpec",
    "H100_SXM",
    "GENERATION_SCALING",
    "generation_spec",
    "RooflineEfficiency",
    "DEFAULT_GRID",
    "ProfileTable",
    "roofline_seconds",
    "roofline_table",
    "project_table",
    "load_table",
    "default_table",
    "DEFAULT_TABLE_PATH",
    "TABLE_FORMAT",
]

TABLE_FORMAT = "netsim-compute-table/1"
DEFAULT_TABLE_PATH = Path(__file__).parent / "data" / "h100_roofline.json"


@dataclass(frozen=True)
class GpuSpec:
    """Public datasheet numbers (dense, no sparsity). Bytes and FLOPs per second, bytes, watts."""

    name: str
    fp8_flops: float
    bf16_flops: float
    mem_bandwidth: float
    mem_capacity: float
    link_bandwidth: float  # scale-up bandwidth per GPU, one direction (the 1x provision)
    tdp_w: float

    def as_dict(self) -> dict:
        return asdict(self)


# NVIDIA H100 SXM5 datasheet: 1,979 TFLOPS FP8 and 989 TFLOPS BF16 dense (half the "with sparsity"
# figures), 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s bidirectional, up to 700 W.
H100_SXM = GpuSpec("NVIDIA H100 SXM5 80GB", 1978.9e12, 989.4e12, 3.35e12, 80e9, 450e9, 700.0)

# Paper Table 5: scaling relative to H100 (FP8 FLOP/s, memory capacity, memory bandwidth, link BW).
GENERATION_SCALING: dict[str, dict[str, float]] = {
    "h100": {"flops": 1.0, "mem_capacity": 1.0, "mem_bandwidth": 1.0, "link_bandwidth": 1.0},
    "blackwell": {"flops": 2.56, "mem_capacity": 2.33, "mem_bandwidth": 2.39, "link_bandwidth": 2.00},
    "rubin": {"flops": 4.49, "mem_capacity": 3.60, "mem_bandwidth": 6.57, "link_bandwidth": 4.00},
}


def generation_spec(name: str, base: GpuSpec = H100_SXM) -> GpuSpec:
    """``base`` scaled by Table 5 (BF16 is assumed to scale like FP8)."""
    if name not in GENERATION_SCALING:
        raise ValueError(f"unknown GPU generation {name!r} (choose from {', '.join(GENERATION_SCALING)})")
    s = GENERATION_SCALING[name]
    if name == "h100":
        return base
    return GpuSpec(f"{name} (H100 x Table 5)", base.fp8_flops * s["flops"], base.bf16_flops * s["flops"],
                   base.mem_bandwidth * s["mem_bandwidth"], base.mem_capacity * s["mem_capacity"],
                   base.link_bandwidth * s["link_bandwidth"], base.tdp_w)  # fmt: skip


@dataclass(frozen=True)
class RooflineEfficiency:
    """Fractions of peak a kernel reaches, plus a fixed cost per kernel. These are assumptions for
    typical serving-framework kernels at decode shapes, below the best published kernels (DeepGEMM
    FP8 GEMMs reach ~1,100-1,500 of 1,979 TFLOPS at large shapes, FlashMLA ~3,000 of 3,350 GB/s
    memory-bound and ~600 of 989 TFLOPS compute-bound); the per-kernel cost stands for tail effects
    and gaps between kernels that CUDA graphs do not remove. docs/results/netsim.md reports how the
    findings move with the best-kernel values (0.6 / 0.8 / 0.6 / 0.85 / 0.6)."""

    gemm_compute: float = 0.45
    gemm_memory: float = 0.75
    attention_compute: float = 0.5
    attention_memory: float = 0.8
    memory_only: float = 0.5
    kernel_overhead_s: float = 3e-6

    def __post_init__(self):
        for f in ("gemm_compute", "gemm_memory", "attention_compute", "attention_memory", "memory_only"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise ValueError(f"efficiency {f} must be in (0, 1], got {v}")
        if self.kernel_overhead_s < 0:
            raise ValueError("kernel_overhead_s must be >= 0")


def _peaks(roof: Roof, gpu: GpuSpec, eff: RooflineEfficiency) -> tuple[float, float]:
    if roof == Roof.GEMM_FP8:
        return gpu.fp8_flops * eff.gemm_compute, gpu.mem_bandwidth * eff.gemm_memory
    if roof == Roof.GEMM_BF16:
        return gpu.bf16_flops * eff.gemm_compute, gpu.mem_bandwidth * eff.gemm_memory
    if roof == Roof.ATTENTION:
        return gpu.bf16_flops * eff.attention_compute, gpu.mem_bandwidth * eff.attention_memory
    return gpu.bf16_flops, gpu.mem_bandwidth * eff.memory_only


def roofline_seconds(flops, nbytes, roof: Roof, gpu: GpuSpec, eff: RooflineEfficiency,
                     num_kernels: int = 0) -> np.ndarray:  # fmt: skip
    """``max(flops / achievable FLOP/s, bytes / achievable bytes/s) + num_kernels * overhead``."""
    f, b = _peaks(Roof(roof), gpu, eff)
    return np.maximum(np.asarray(flops) / f, np.asarray(nbytes) / b) + num_kernels * eff.kernel_overhead_s


def geometry(lo: int, hi: int, per_octave: int = 2) -> tuple[float, ...]:
    """Integers from lo to hi, ``per_octave`` roughly geometric steps per doubling."""
    vals = {lo, hi}
    k = 0
    while True:
        v = int(round(lo * 2 ** (k / per_octave)))
        if v > hi:
            break
        vals.add(v)
        k += 1
    return tuple(float(v) for v in sorted(vals))


DEFAULT_GRID: dict[str, tuple[float, ...]] = {
    "tokens": geometry(1, 65536),
    "routed_tokens": geometry(1, 1 << 19),
    "requests": geometry(1, 8192),
    "ctx": (128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0),
    "q_len": (1.0, 2.0, 3.0, 4.0, 6.0, 8.0),
    "tp": (1.0, 2.0, 4.0, 8.0),
    "experts": (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0),
    "latent": (448.0, 896.0, 1792.0, 3584.0, 7168.0),  # BigMac r = 1/16 .. 1 of hidden 7168
}


@dataclass
class KindTable:
    axes: tuple[str, ...]
    grid: tuple[np.ndarray, ...]
    seconds: np.ndarray
    flops: np.ndarray
    nbytes: np.ndarray
    _interp: Optional[RegularGridInterpolator] = None

    def interp(self) -> RegularGridInterpolator:
        if self._interp is None:
            self._interp = RegularGridInterpolator(self.grid, self.seconds, method="linear",
                                                   bounds_error=False, fill_value=None)  # fmt: skip
        return self._interp


@dataclass
class ProfileTable:
    """Per-kind times on a grid. ``seconds(kind, **axes)`` interpolates (arrays broadcast)."""

    provenance: dict
    model: ModelShape
    kinds: dict[LayerKind, KindTable]

    def seconds(self, kind: LayerKind | str, **axes) -> np.ndarray:
        kind = LayerKind(kind)
        if kind not in self.kinds:
            raise ValueError(f"compute table has no entry for layer kind {kind.value!r}")
        kt = self.kinds[kind]
        if set(axes) != set(kt.axes):
            raise ValueError(f"{kind.value}: expected axes {kt.axes}, got {tuple(sorted(axes))}")
        arrs = np.broadcast_arrays(*(np.asarray(axes[a], dtype=float) for a in kt.axes))
        pts = []
        for name, g, v in zip(kt.axes, kt.grid, arrs):
            if name in ("tp", "experts", "q_len", "latent") and (np.any(v < g[0] - 1e-9) or np.any(v > g[-1] + 1e-9)):
                raise ValueError(f"{kind.value}: {name} outside the table's grid [{g[0]:g}, {g[-1]:g}]")
            pts.append(np.maximum(v, g[0]))  # below the grid: the smallest measured point
        shape = arrs[0].shape
        out = kt.interp()(np.stack([p.ravel() for p in pts], axis=-1))
        return np.maximum(out, 0.0).reshape(shape)

    def to_json(self) -> dict:
        kinds = {}
        for k, kt in self.kinds.items():
            kinds[k.value] = {
                "axes": list(kt.axes),
                "grid": [[float(x) for x in g] for g in kt.grid],
                "seconds": [float(f"{x:.6g}") for x in kt.seconds.ravel()],
                "flops": [float(f"{x:.6g}") for x in kt.flops.ravel()],
                "bytes": [float(f"{x:.6g}") for x in kt.nbytes.ravel()],
            }
        return {"format": TABLE_FORMAT, "provenance": self.provenance, "model": self.model.as_dict(), "kinds": kinds}

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json(), indent=None)

    @classmethod
    def from_json(cls, d: Mapping, where: str = "compute table") -> "ProfileTable":
        if d.get("format") != TABLE_FORMAT:
            raise ValueError(f"{where}: not a {TABLE_FORMAT} file (format={d.get('format')!r})")
        try:
            model = ModelShape.from_dict(d["model"])
            kinds = {}
            for name, e in d["kinds"].items():
                kind = LayerKind(name)
                grid = tuple(np.asarray(g, dtype=float) for g in e["grid"])
                shape = tuple(len(g) for g in grid)
                arr = {k: np.asarray(e[k], dtype=float).reshape(shape) for k in ("seconds", "flops", "bytes")}
                if tuple(e["axes"]) != KIND_AXES[kind]:
                    raise ValueError(f"{name}: axes {e['axes']} != {list(KIND_AXES[kind])}")
                kinds[kind] = KindTable(tuple(e["axes"]), grid, arr["seconds"], arr["flops"], arr["bytes"])
            return cls(dict(d["provenance"]), model, kinds)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: malformed compute table ({e})") from None


def load_table(path: str | os.PathLike) -> ProfileTable:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such compute table")
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON compute table ({e})") from None
    return ProfileTable.from_json(d, str(path))


_DEFAULT: Optional[ProfileTable] = None


def default_table() -> ProfileTable:
    """The shipped H100 roofline-estimate table (loaded once)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = load_table(DEFAULT_TABLE_PATH)
    return _DEFAULT


def kind_grid(kind: LayerKind, grid: Mapping[str, tuple] = DEFAULT_GRID) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(grid[a], dtype=float) for a in KIND_AXES[kind])


def roofline_table(
    model: ModelShape = DEEPSEEK_V3,
    gpu: GpuSpec = H100_SXM,
    eff: RooflineEfficiency = RooflineEfficiency(),
    grid: Mapping[str, tuple] = DEFAULT_GRID,
) -> ProfileTable:
    """A table estimated by the roofline: no measurement involved (``method: roofline-estimate``)."""
    kinds = {}
    for kind, axes in KIND_AXES.items():
        g = kind_grid(kind, grid)
        mesh = np.meshgrid(*g, indexing="ij")
        flops, nbytes, nk, roof = kernel_work(kind, model, **dict(zip(axes, mesh)))
        flops, nbytes = np.broadcast_to(flops, mesh[0].shape), np.broadcast_to(nbytes, mesh[0].shape)
        secs = roofline_seconds(flops, nbytes, roof, gpu, eff, nk)
        kinds[kind] = KindTable(axes, g, secs, np.array(flops, dtype=float), np.array(nbytes, dtype=float))
    prov = {
        "method": "roofline-estimate",
        "gpu": gpu.name,
        "note": ("NOT MEASURED: max(FLOPs / achievable FLOP/s, bytes / achievable bytes/s) + a fixed cost per "
                 "kernel, from public datasheet numbers and assumed efficiencies. Regenerate with "
                 "scripts/profile_netsim_compute.py on a real GPU for measured times."),
        "gpu_spec": gpu.as_dict(),
        "efficiency": asdict(eff),
        "generated_by": "python -m netsim compute-table",
    }
    return ProfileTable(prov, model, kinds)


def project_table(table: ProfileTable, target: GpuSpec, source: Optional[GpuSpec] = None,
                  eff: RooflineEfficiency = RooflineEfficiency()) -> ProfileTable:  # fmt: skip
    """The table moved to ``target``: each point's time divided by its roofline speedup
    ``max(F/f_src, B/b_src) / max(F/f_tgt, B/b_tgt)`` (paper §4.5). ``source`` defaults to the
    table's recorded ``gpu_spec``."""
    if source is None:
        spec = table.provenance.get("gpu_spec")
        if not spec:
            raise ValueError("compute table records no gpu_spec; pass the source GPU explicitly")
        source = GpuSpec(**spec)
    kinds = {}
    for kind, kt in table.kinds.items():
        _, _, _, roof = kernel_work(kind, table.model, **{a: 1.0 for a in kt.axes})
        src = roofline_seconds(kt.flops, kt.nbytes, roof, source, eff)
        tgt = roofline_seconds(kt.flops, kt.nbytes, roof, target, eff)
        speedup = np.where(tgt > 0, src / np.where(tgt > 0, tgt, 1.0), 1.0)
        kinds[kind] = replace(kt, seconds=kt.seconds / speedup, _interp=None)
    prov = dict(table.provenance)
    prov["projected_to"] = target.as_dict()
    prov["projection"] = "per-point roofline speedup from the source GPU's datasheet numbers (paper §4.5)"
    prov["gpu_spec"] = target.as_dict()
    return ProfileTable(prov, table.model, kinds)
