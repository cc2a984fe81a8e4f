"""Fit the alpha-beta constants to measured collective times (paper §3.2.2, Table 1).

Measurements are rows ``(op, ranks, bytes, seconds)``: the calibration CSV of
``scripts/bench_ep.py --collectives`` (columns ``op,ranks,bytes,seconds``; other columns ignored),
or nccl-tests output (``all_reduce_perf`` / ``alltoall_perf``; the out-of-place time column).
``bytes`` follows :mod:`netsim.collectives`' convention: the per-rank input size.

With each row's algorithm fixed, the model ``T = alpha0 + R alpha_round + D alpha_dest + W / eta`` is
linear in ``theta = (alpha0, alpha_round, alpha_dest, 1/eta)``, so a fit is a non-negative least
squares on relative residuals (each row divided by its measured time), refined by iteratively
reweighted least squares towards the mean absolute relative error, the paper's metric.
``W`` is the wire time at the nominal per-rank bandwidth; if the bandwidth is unknown it is 1 byte/s
and the last coefficient is the effective seconds per byte instead of ``1/eta``.

Which algorithm ran is unknown for NCCL (it picks internally), so ``auto`` searches the
assignment: every uniform one (one algorithm per op for all rows), then rows move to the algorithm
the fitted constants make fastest while that lowers the error. The reported predictions use the
final assignment; ``fastest_fraction`` says how many rows it explains with the model's own fastest
algorithm (what the serving model will assume). Libraries with a fixed algorithm (gloo: a P2P
all-to-all, a ring all-reduce) are best fitted with the algorithm pinned.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
from scipy.optimize import nnls

from megatron.common.cli import UserError

from .collectives import AlphaBeta, Algorithm, Collective, Network, Topology, algorithms

__all__ = [
    "Measurement",
    "FitResult",
    "read_csv",
    "check_rows",
    "read_nccl_tests",
    "read_sidecar_bandwidth",
    "read_bench_sidecar",
    "fit_per_op",
    "BURST_GRID",
    "fit_constants",
    "predict",
    "synthetic_measurements",
    "FIT_TOPOLOGIES",
]

_OP_ALIASES = {
    "all_to_all": Collective.ALL_TO_ALL, "alltoall": Collective.ALL_TO_ALL, "all-to-all": Collective.ALL_TO_ALL,
    "a2a": Collective.ALL_TO_ALL, "all_reduce": Collective.ALL_REDUCE, "allreduce": Collective.ALL_REDUCE,
    "all-reduce": Collective.ALL_REDUCE, "ar": Collective.ALL_REDUCE,
}  # fmt: skip

# one constant set per fit: scale-out has two tiers, so fit each tier on its own (intra-node
# measurements with `scale-up` or `switch`, inter-node ones with `switch`)
FIT_TOPOLOGIES = (Topology.SWITCH, Topology.SCALE_UP, Topology.TORUS_3D, Topology.FULL_MESH_3D)


@dataclass(frozen=True)
class Measurement:
    op: Collective
    ranks: int
    bytes: float
    seconds: float


def _parse_op(s: str, where: str) -> Collective:
    op = _OP_ALIASES.get(s.strip().lower())
    if op is None:
        raise ValueError(f"{where}: unknown op {s!r} (expected all_to_all or all_reduce)")
    return op


def _csv_rows(path: Path, reader) -> list[Measurement]:
    cols = set(reader.fieldnames or ())
    missing = {"op", "ranks", "bytes", "seconds"} - cols
    if missing:
        raise ValueError(f"{path}: missing CSV column(s) {', '.join(sorted(missing))} "
                         f"(need op,ranks,bytes,seconds; have {', '.join(sorted(cols)) or 'none'})")  # fmt: skip
    rows = []
    for i, r in enumerate(reader, start=2):
        where = f"{path}:{i}"
        try:
            m = Measurement(_parse_op(r["op"], where), int(r["ranks"]), float(r["bytes"]), float(r["seconds"]))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: bad row ({e})") from None
        if m.ranks < 2 or m.bytes <= 0 or not m.seconds > 0:
            raise ValueError(f"{where}: need ranks >= 2, bytes > 0 and seconds > 0")
        rows.append(m)
    return rows


def read_csv(path: str | os.PathLike) -> list[Measurement]:
    """Rows of a ``op,ranks,bytes,seconds`` CSV (header required; extra columns are ignored)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such CSV file")
    try:
        with open(path, newline="") as f:
            rows = _csv_rows(path, csv.DictReader(f))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text CSV file (undecodable byte at offset {e.start})") from None
    except csv.Error as e:
        raise ValueError(f"{path}: not a CSV file ({e})") from None
    if not rows:
        raise ValueError(f"{path}: no measurements")
    return rows


def read_sidecar_bandwidth(csv_path: str | os.PathLike) -> Optional[float]:
    """Per-rank link bandwidth (bytes/s) from bench_ep's sidecar JSON (``link.gbit``), if present."""
    side = Path(csv_path).with_suffix(".json")
    if not side.is_file():
        return None
    try:
        gbit = json.loads(side.read_text())["link"]["gbit"]
        return float(gbit) * 1e9 / 8
    except (ValueError, KeyError, TypeError):
        return None


BENCH_STATISTICS = {"median": "seconds", "min": "min_s", "mean": "mean_s"}


def read_bench_sidecar(csv_path: str | os.PathLike, statistic: str = "median") -> list[Measurement]:
    """Rows of a bench_ep calibration with another per-row statistic over the repeats, from its
    sidecar JSON (``rows[*].min_s`` / ``mean_s``; ``median`` is the CSV's own ``seconds``)."""
    if statistic not in BENCH_STATISTICS:
        raise ValueError(f"--statistic must be one of {', '.join(BENCH_STATISTICS)}, got {statistic!r}")
    if statistic == "median":
        return read_csv(csv_path)
    side = Path(csv_path).with_suffix(".json")
    try:
        d = json.loads(side.read_text())
        key = BENCH_STATISTICS[statistic]
        rows = [Measurement(_parse_op(r["op"], str(side)), int(r["ranks"]), float(r["bytes"]), float(r[key]))
                for r in d["rows"]]  # fmt: skip
    except FileNotFoundError:
        raise ValueError(f"{side}: no sidecar JSON next to the CSV (needed for --statistic {statistic})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{side}: not a bench_ep calibration sidecar ({e})") from None
    if not rows:
        raise ValueError(f"{side}: no rows")
    return rows


_NCCL_OP = re.compile(r"(all_?reduce|all_?to_?all)_perf", re.IGNORECASE)


def read_nccl_tests(path: str | os.PathLike, op: Optional[str] = None, ranks: Optional[int] = None) -> list[Measurement]:
    """Rows of an nccl-tests log (``all_reduce_perf`` / ``alltoall_perf``): ``size`` and the first
    (out-of-place) ``time`` column, in microseconds.

    The op comes from the ``# Collective test starting: <name>_perf`` banner or the command line in
    the log, else ``op``; the rank count from the ``#  Rank N ...`` device lines, else ``ranks``.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such nccl-tests file")
    text = path.read_text(errors="replace").splitlines()
    found_op = None
    rank_lines = 0
    header = None
    data = []
    for line in text:
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            body = s.lstrip("#").strip()
            m = _NCCL_OP.search(body)
            if m and found_op is None:
                found_op = _parse_op(m.group(1).replace("toall", "_to_all").replace("reduce", "_reduce")
                                     .replace("__", "_"), str(path))  # fmt: skip
            if re.match(r"Rank\s+\d+\s+Group", body):
                rank_lines += 1
            toks = body.split()
            if toks[:1] == ["size"] and "time" in toks:
                header = toks
            continue
        if header is None:
            m = _NCCL_OP.search(s)
            if m and found_op is None:
                found_op = _parse_op(m.group(1).replace("toall", "_to_all").replace("reduce", "_reduce")
                                     .replace("__", "_"), str(path))  # fmt: skip
            continue
        toks = s.split()
        if not toks[0].isdigit():
            continue
        ti = header.index("time")
        try:
            data.append((float(toks[0]), float(toks[ti]) * 1e-6))
        except (ValueError, IndexError):
            raise ValueError(f"{path}: cannot read the size/time columns of {s!r}") from None
    use_op = _parse_op(op, str(path)) if op else found_op
    if use_op is None:
        raise ValueError(f"{path}: cannot tell the collective from the log; pass --op")
    use_ranks = ranks or rank_lines
    if not use_ranks or use_ranks < 2:
        raise ValueError(f"{path}: cannot tell the number of ranks from the log; pass --ranks")
    rows = [Measurement(use_op, int(use_ranks), b, t) for b, t in data if b > 0 and t > 0]
    if not rows:
        raise ValueError(f"{path}: no data rows (expected nccl-tests output with a '# size ... time' header)")
    return rows


def check_rows(rows: Sequence[Measurement]) -> None:
    """``ValueError`` unless the rows can be fitted: latency and bandwidth can be told apart only
    from measurements at two or more message sizes (one size gives an unbounded bandwidth)."""
    if not rows:
        raise ValueError("no measurements to fit")
    sizes = {m.bytes for m in rows}
    if len(sizes) < 2:
        raise ValueError(f"fit: {len(rows)} measurement(s), all at {int(next(iter(sizes)))} bytes: latency and "
                         "bandwidth can be told apart only from two or more message sizes")


def _fit_network(topology: Topology, ranks: int, bandwidth: float, constants: AlphaBeta) -> Network:
    return Network(topology, ranks, bandwidth, constants=constants)


def _candidates(rows: Sequence[Measurement], topology: Topology, bandwidth: float,
                allowed: dict[Collective, str]) -> list[list[Algorithm]]:  # fmt: skip
    unit = AlphaBeta(0.0, 0.0, 0.0, 1.0)  # features only: rounds, dests, wire_per_byte
    cache: dict = {}
    out = []
    for m in rows:
        key = (m.op, m.ranks)
        if key not in cache:
            algos = list(algorithms(_fit_network(topology, m.ranks, bandwidth, unit), m.op, m.ranks))
            if m.op in allowed:
                algos = [a for a in algos if a.name == allowed[m.op]]
                if not algos:
                    raise UserError(f"algorithm {allowed[m.op]!r} is not available for {m.op.value} on "
                                    f"{topology.value} with {m.ranks} ranks")  # fmt: skip
            cache[key] = algos
        out.append(cache[key])
    return out


def _features(a: Algorithm, nbytes: float, bw: float = 1.0, burst: float = 0.0) -> np.ndarray:
    wire = a.wire_per_byte * nbytes
    if burst:
        wire = max(0.0, wire * bw - burst) / bw  # the first `burst` bytes on the link pass unshaped
    return np.array([1.0, a.rounds, a.dests, wire])


def _solve(X: np.ndarray, t: np.ndarray, irls_steps: int = 20) -> np.ndarray:
    """Non-negative theta minimising relative error: NNLS on rows scaled by 1/t, then IRLS towards
    the L1 norm of relative residuals."""
    A = X / t[:, None]
    scale = np.maximum(np.abs(A).max(axis=0), 1e-300)  # column scaling for conditioning
    theta = nnls(A / scale, np.ones_like(t), maxiter=50 * A.shape[1])[0] / scale
    best, best_err = theta, np.mean(np.abs(A @ theta - 1))
    for _ in range(irls_steps):
        w = 1 / np.sqrt(np.maximum(np.abs(A @ theta - 1), 1e-4))
        Aw = A * w[:, None]
        theta = nnls(Aw / scale, w, maxiter=50 * A.shape[1])[0] / scale
        err = np.mean(np.abs(A @ theta - 1))
        if err < best_err - 1e-12:
            best, best_err = theta, err
    return best


def _polish_fastest(cands, nb, t, bw, burst, starts, best_theta, max_starts: int = 8):
    """Nelder-Mead on the mean relative error of the model itself, ``min_j features_j . theta``
    (``theta = |x| * scale``, each coordinate scaled to explain the data alone), from several starts."""
    from scipy.optimize import minimize

    n, J = len(cands), max(len(c) for c in cands)
    F = np.full((n, J, 4), np.nan)
    for i, algos in enumerate(cands):
        for j, a in enumerate(algos):
            F[i, j] = _features(a, nb[i], bw, burst)

    def err(theta):
        pred = np.nanmin(F @ theta, axis=1)
        return float(np.mean(np.abs(t - pred) / t))

    col = np.nanmedian(F[:, 0, :], axis=0)
    scale = np.where(col > 0, np.median(t) / np.where(col > 0, col, 1.0), 1.0)

    def obj(x):
        return err(np.abs(x) * scale)

    best = (best_theta, err(best_theta))
    uniq = [best_theta]
    for th in starts:
        if not any(np.allclose(th, u) for u in uniq):
            uniq.append(th)
    for th in uniq[:max_starts]:
        x0 = th / scale
        simplex = np.vstack([x0] + [x0 + 0.3 * np.eye(4)[k] for k in range(4)])
        r = minimize(obj, x0, method="Nelder-Mead",
                     options={"initial_simplex": simplex, "xatol": 1e-12, "fatol": 1e-14, "maxiter": 3000})  # fmt: skip
        cand = np.abs(r.x) * scale
        e = err(cand)
        if e < best[1]:
            best = (cand, e)
    return best


@dataclass
class FitResult:
    constants: AlphaBeta
    bandwidth: Optional[float]  # bytes/s the utilisation refers to; None: fitted beta is s/byte
    beta_s_per_byte: float  # effective seconds per byte of wire traffic (1 / (eta * bandwidth))
    topology: Topology
    mean_relative_error: float
    max_relative_error: float
    per_op_error: dict
    relative_errors: np.ndarray = field(repr=False)
    predicted: np.ndarray = field(repr=False)
    algorithms: list = field(repr=False)
    identifiable: bool = True
    fastest_fraction: float = 1.0  # rows whose fitted algorithm is the fastest under the constants
    burst_bytes: float = 0.0  # shaper burst per call (0: the paper's model)

    def as_dict(self) -> dict:
        counts: dict = {}
        for m_alg in self.algorithms:
            counts[m_alg] = counts.get(m_alg, 0) + 1
        return {
            "topology": self.topology.value,
            "constants": self.constants.as_dict(),
            "bandwidth_bytes_per_s": self.bandwidth,
            "beta_s_per_byte": self.beta_s_per_byte,
            "effective_bandwidth_bytes_per_s": 1 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else None,
            "mean_relative_error": self.mean_relative_error,
            "max_relative_error": self.max_relative_error,
            "per_op_mean_relative_error": self.per_op_error,
            "algorithm_counts": counts,
            "latencies_identifiable": self.identifiable,
            "fastest_algorithm_fraction": self.fastest_fraction,
            "burst_bytes": self.burst_bytes,
        }


BURST_GRID = (0.0,) + tuple(float(round(2 ** (k / 2))) for k in range(20, 49))  # 1 KiB .. 16 MiB


def fit_constants(
    rows: Sequence[Measurement],
    topology: Topology | str = Topology.SWITCH,
    bandwidth: Optional[float] = None,
    algorithm: Optional[dict] = None,
    burst: float | str = 0.0,
    max_iters: int = 20,
) -> FitResult:
    """Fit one tier's constants to ``rows``.

    ``bandwidth``: nominal per-rank bandwidth, bytes/s (for the utilisation; None fits seconds per
    byte directly). ``algorithm``: ``{op: name}`` pins the algorithm for that op; the others are
    chosen per row (``auto``). ``burst``: bytes per call that pass the bottleneck link before its
    rate limit applies (a token-bucket shaper such as ``tc tbf``; 0 for real interconnects, the
    paper's model), or ``"auto"`` to pick the best of :data:`BURST_GRID`.
    """
    if burst == "auto":
        fits = [_fit(rows, topology, bandwidth, algorithm, b, max_iters) for b in BURST_GRID]
        return min(fits, key=lambda f: f.mean_relative_error)
    if isinstance(burst, str) or not burst >= 0:
        raise UserError(f"--burst must be >= 0 bytes or 'auto', got {burst!r}")
    return _fit(rows, topology, bandwidth, algorithm, float(burst), max_iters)


def _fit(rows, topology, bandwidth, algorithm, burst: float, max_iters: int) -> FitResult:
    topology = Topology(topology)
    if topology not in FIT_TOPOLOGIES:
        raise ValueError(f"--topology {topology.value}: fit one network tier at a time "
                         f"(choose from {', '.join(t.value for t in FIT_TOPOLOGIES)})")  # fmt: skip
    check_rows(rows)
    if bandwidth is not None and not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    allowed = {Collective(k): v for k, v in (algorithm or {}).items()}
    bw = bandwidth or 1.0
    cands = _candidates(rows, topology, bw, allowed)
    t = np.array([m.seconds for m in rows])
    nb = np.array([m.bytes for m in rows])

    def fit_assignment(assign: list[int]) -> tuple[np.ndarray, float]:
        X = np.stack([_features(cands[i][j], nb[i], bw, burst) for i, j in enumerate(assign)])
        theta = _solve(X, t)
        return theta, float(np.mean(np.abs(X @ theta - t) / t))

    def fastest(theta: np.ndarray) -> list[int]:
        return [int(np.argmin([_features(a, nb[i], bw, burst) @ theta for a in algos])) for i, algos in enumerate(cands)]

    # start from every uniform assignment (one algorithm, by name, per op for all rows); from each,
    # let rows take the algorithm the constants make fastest while that lowers the error; keep the best
    ops = sorted({m.op for m in rows}, key=lambda o: o.value)
    names_per_op = {o: sorted({a.name for i, m in enumerate(rows) if m.op == o for a in cands[i]}) for o in ops}
    best, starts = None, []
    for combo in itertools.product(*(names_per_op[o] for o in ops)):
        pick = dict(zip(ops, combo))
        assign = []
        for i, m in enumerate(rows):
            names = [a.name for a in cands[i]]
            assign.append(names.index(pick[m.op]) if pick[m.op] in names else 0)
        theta, err = fit_assignment(assign)
        for _ in range(max_iters):
            new_assign = fastest(theta)
            if new_assign == assign:
                break
            theta2, err2 = fit_assignment(new_assign)
            if err2 >= err - 1e-12:
                break
            theta, err, assign = theta2, err2, new_assign
        starts.append(theta)
        if best is None or err < best[1] - 1e-12:
            best = (theta, err, assign)
    theta, err, assign = best
    # the local search above can stop in a poor assignment; also minimise the error of the model
    # itself (fastest algorithm per row) directly over theta, from the best starts
    theta_nm, err_nm = _polish_fastest(cands, nb, t, bw, burst, starts, theta)
    if err_nm < err - 1e-12:
        theta, err, assign = theta_nm, err_nm, fastest(theta_nm)
    X = np.stack([_features(cands[i][j], nb[i], bw, burst) for i, j in enumerate(assign)])
    pred = X @ theta
    best_t = np.array([min(_features(a, nb[i], bw, burst) @ theta for a in algos) for i, algos in enumerate(cands)])
    consistent = float(np.mean(pred <= best_t * (1 + 1e-9)))  # ties count as fastest
    rel = (t - pred) / t  # the paper's signed relative error; its mean absolute value is reported
    identifiable = bool(np.linalg.matrix_rank(X[:, :3] / t[:, None], tol=1e-9) == 3)
    per_op = {o.value: float(np.mean(np.abs(rel[[m.op == o for m in rows]]))) for o in ops}
    a0, ar, ad, inv_eta = (float(x) for x in theta)
    util = 1 / inv_eta if inv_eta > 0 else float("inf")
    return FitResult(
        constants=AlphaBeta(a0, ar, ad, util),
        bandwidth=bandwidth,
        beta_s_per_byte=inv_eta / bw,
        topology=topology,
        mean_relative_error=float(np.mean(np.abs(rel))),
        max_relative_error=float(np.max(np.abs(rel))),
        per_op_error=per_op,
        relative_errors=rel,
        predicted=pred,
        algorithms=[f"{m.op.value}:{cands[i][j].name}" for i, (m, j) in enumerate(zip(rows, assign))],
        identifiable=identifiable,
        fastest_fraction=consistent,
        burst_bytes=burst,
    )


def fit_per_op(rows: Sequence[Measurement], *args, **kwargs) -> tuple[dict, float]:
    """Separate constants per collective (e.g. gloo's all-to-all and all-reduce are different code
    paths with different overheads): ``({op: FitResult}, mean relative error over all rows)``."""
    out, errs = {}, []
    for op in sorted({m.op for m in rows}, key=lambda o: o.value):
        res = fit_constants([m for m in rows if m.op == op], *args, **kwargs)
        out[op.value] = res
        errs.append(np.abs(res.relative_errors))
    return out, float(np.mean(np.concatenate(errs)))


def predict(rows: Iterable[Measurement], topology: Topology | str, bandwidth: float, constants: AlphaBeta) -> np.ndarray:
    """Model seconds for each row (fastest algorithm) under ``constants``."""
    topology = Topology(topology)
    out = []
    for m in rows:
        algos = algorithms(_fit_network(topology, m.ranks, bandwidth, constants), m.op, m.ranks)
        out.append(min(float(a.time(m.bytes)) for a in algos))
    return np.array(out)


def synthetic_measurements(
    constants: AlphaBeta,
    bandwidth: float,
    topology: Topology | str = Topology.SWITCH,
    ranks: Sequence[int] = (4, 8, 16, 32),
    sizes: Sequence[float] = tuple(2.0**k for k in range(7, 31, 2)),
    ops: Sequence[str] = ("all_to_all", "all_reduce"),
    noise: float = 0.0,
    seed: int = 0,
) -> list[Measurement]:
    """Rows generated by the model itself (fastest algorithm), times a log-normal noise factor of
    relative spread ``noise``: ground truth for testing the fit."""
    rng = np.random.default_rng(seed)
    rows = []
    for op in ops:
        for p in ranks:
            for b in sizes:
                rows.append(Measurement(Collective(op), int(p), float(b), 1.0))
    t = predict(rows, topology, bandwidth, constants)
    if noise:
        t = t * np.exp(rng.normal(0.0, noise, size=t.shape))
    return [Measurement(m.op, m.ranks, m.bytes, float(s)) for m, s in zip(rows, t)]
