"""Decode-phase serving model: TPOT, the largest batch under memory and an SLO, throughput (§3.1-3.3).

For a network, an attention TP size ``tp`` and an expert-parallel size ``ep``, one decode step of a
batch of ``b`` requests per attention TP group (``b`` requests on every GPU of the group) is the
op chain below, per layer, on two lanes (``C`` compute, ``M`` communication):

    dense layer:  C attention | M all-reduce (tp) | C dense FFN | M all-reduce (tp)
    MoE layer:    C attention | M all-reduce (tp) | C router (+ BigMac down-projection)
                  | M dispatch all-to-all (ep) | C routed + shared experts | M combine all-to-all (ep)
    end:          C (BigMac up-projection of the last layer +) lm_head

(a MoE layer's BigMac up-projection is folded into the next layer's attention op). Compute times
come from the profile table (:mod:`netsim.compute`), communication from the fastest alpha-beta
algorithm (:mod:`netsim.collectives`).

* **No overlap**: TPOT = the sum of all ops (or the one-lane-each schedule when FarSkip overlaps).
* **DBO**: two micro-batches of ``b/2`` on the greedy two-lane schedule (:mod:`netsim.schedule`).
* **Speculative decoding** (Medusa-style, §3.3): ``TPOT = (T_draft + T_verify) / (1 + n p)`` with
  ``n`` drafted tokens and average pass rate ``p``; ``T_verify`` is a step whose attention has
  ``n + 1`` queries per request and whose other ops see ``(n + 1) b`` tokens; ``T_draft`` is one
  normal decode step (the paper's model, default) or 0 for heads fused into verification
  (:class:`DraftCost`).
* **Memory**: weights per GPU (:meth:`ModelShape.weight_bytes_per_gpu`) plus ``b x context`` tokens
  of latent KV cache must fit ``mem_usable_fraction`` of HBM.
* **Throughput per XPU** = ``b / (tp * TPOT)`` (every GPU serves ``b / tp`` of its group's tokens).
* **Loop control** (:class:`LoopControl`, off by default): each decode iteration (a speculative
  cycle: one) also pays the serving loop's control exchange that ``netsim.replay``'s replay/8 adds
  to its replay of served runs (``megatron.inference.loop``): the requests' header all-gather and
  the new tokens' gather over the instance's ``ep`` ranks, each latency-bound, priced as the
  network's fastest all-reduce of :data:`CONTROL_BYTES` (the model's collectives are all-reduce and
  all-to-all); serial with the step, so no technique hides it.

Variants (:class:`Variant`): BigMac multiplies all-to-all bytes by ``r`` and adds the shared
hidden <-> ``r * hidden`` projections; Sem-MoE's local activation rate ``L`` scales the off-rank
bytes by ``(1 - L) / (1 - 1/ep)`` (uniform routing keeps ``1/ep`` local); FarSkip lets the op after
each all-to-all overlap a fraction ``f`` of it. Their combination applies all three.

Shapes: arrays ``[C, B]`` are cases x batch grid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Sequence

import numpy as np

from .collectives import Collective, Network, algorithms
from .compute import ProfileTable, geometry, default_table
from .model import DEEPSEEK_V3, LayerKind, ModelShape
from .schedule import COMM, COMPUTE, greedy_schedule

__all__ = [
    "DraftCost",
    "SpecDecode",
    "LoopControl",
    "CONTROL_BYTES",
    "Variant",
    "BASELINE",
    "Technique",
    "Optimization",
    "OPTIMIZATION_TECHNIQUES",
    "ServingConfig",
    "Case",
    "CaseResults",
    "evaluate_cases",
    "best_under_slo",
    "max_batch_memory",
    "decode_ops",
]


class DraftCost(str, Enum):
    DECODE_STEP = "decode-step"
    """Drafting costs one normal decode iteration per cycle, on top of verification: the paper's
    model (§3.3: "[T_draft] is modeled as one normal decode iteration")."""
    FREE = "free"
    """Medusa-style heads drafting from the verification pass's hidden states at no extra step: an
    optimistic alternative, not the paper's model."""


class LoopControl(str, Enum):
    """What a decode iteration pays outside its forward."""

    NONE = "none"
    """Nothing: TPOT is the step's op chain (the paper's model)."""
    EXCHANGE = "exchange"
    """The serving loop's two small collectives per iteration (see the module docstring)."""


CONTROL_BYTES = 64  # one control message: a request header or a rank's new tokens, latency-bound either way


@dataclass(frozen=True)
class SpecDecode:
    """Speculative decoding (the paper assumes Medusa-style heads). ``TPOT = (T_draft + T_verify) /
    (1 + n p)``; drafting costs one normal decode iteration, as the paper's text says
    (``DraftCost.DECODE_STEP``). The values of ``n`` and ``p`` did not survive the text extraction;
    ours: 3 drafted tokens, 70% average pass rate -> 3.1 tokens per cycle. ``free`` (drafting fused
    into verification) is the optimistic alternative docs/results/netsim.md compares."""

    num_draft: int = 3
    pass_rate: float = 0.7
    draft_cost: DraftCost = DraftCost.DECODE_STEP

    def __post_init__(self):
        if self.num_draft < 1:
            raise ValueError(f"--num-draft must be >= 1, got {self.num_draft}")
        if not 0 <= self.pass_rate <= 1:
            raise ValueError(f"--pass-rate must be in [0, 1], got {self.pass_rate}")
        object.__setattr__(self, "draft_cost", DraftCost(self.draft_cost))

    @property
    def tokens_per_cycle(self) -> float:
        return 1 + self.num_draft * self.pass_rate


@dataclass(frozen=True)
class Variant:
    """Communication variants as knobs (see the module docstring). Sem-MoE's LAR is one figure
    (``lar``, applied at every EP) or a measured curve ``lar_by_ep`` of ``(ep, lar)`` points, which
    takes precedence: between points the off-rank factor is interpolated in log2(ep), beyond the
    last point it is held (the bytes saved relative to uniform routing stay what was measured)."""

    name: str = "baseline"
    bigmac_ratio: float = 1.0
    lar: Optional[float] = None
    farskip_overlap: float = 0.0
    lar_by_ep: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if not 0 < self.bigmac_ratio <= 1:
            raise ValueError(f"--bigmac-ratio must be in (0, 1], got {self.bigmac_ratio}")
        if self.lar is not None and not 0 <= self.lar < 1:
            raise ValueError(f"--lar must be in [0, 1), got {self.lar}")
        if not 0 <= self.farskip_overlap <= 1:
            raise ValueError(f"--farskip-overlap must be in [0, 1], got {self.farskip_overlap}")
        eps = [e for e, _ in self.lar_by_ep]
        if eps != sorted(set(eps)) or any(e < 2 or not 0 <= v < 1 for e, v in self.lar_by_ep):
            raise ValueError(f"lar_by_ep needs increasing EP sizes >= 2 with an LAR in [0, 1), got {self.lar_by_ep}")

    @property
    def has_lar(self) -> bool:
        return self.lar is not None or bool(self.lar_by_ep)

    def remote_factor(self, ep: int) -> float:
        """Off-rank all-to-all bytes relative to uniform routing (Sem-MoE)."""
        if ep <= 1 or not self.has_lar:
            return 1.0
        if not self.lar_by_ep:
            return (1 - self.lar) / (1 - 1 / ep)
        x = np.log2([e for e, _ in self.lar_by_ep])
        f = [(1 - v) / (1 - 1 / e) for e, v in self.lar_by_ep]
        return float(np.interp(np.log2(ep), x, f))

    def lar_at(self, ep: int) -> Optional[float]:
        """The LAR this variant applies at ``ep`` (None without Sem-MoE)."""
        if not self.has_lar:
            return None
        return 1.0 if ep <= 1 else 1 - self.remote_factor(ep) * (1 - 1 / ep)

    def as_dict(self) -> dict:
        return {"name": self.name, "bigmac_ratio": self.bigmac_ratio, "lar": self.lar,
                "farskip_overlap": self.farskip_overlap, "lar_by_ep": [list(p) for p in self.lar_by_ep]}  # fmt: skip


BASELINE = Variant()


class Technique(str, Enum):
    """One way of running the decode step."""

    NONE = "none"
    DBO = "dbo"
    SD = "sd"
    DBO_SD = "dbo+sd"


class Optimization(str, Enum):
    """A curve of the paper: the best of the techniques it allows at each operating point."""

    NOOPT = "noopt"
    DBO = "dbo"
    DBO_SD = "dbo+sd"


OPTIMIZATION_TECHNIQUES = {
    Optimization.NOOPT: (Technique.NONE,),
    Optimization.DBO: (Technique.NONE, Technique.DBO),
    Optimization.DBO_SD: (Technique.NONE, Technique.DBO, Technique.SD, Technique.DBO_SD),
}


@dataclass(frozen=True)
class ServingConfig:
    model: ModelShape = DEEPSEEK_V3
    mem_capacity: float = 80e9
    mem_usable_fraction: float = 0.9  # the rest: activations, CUDA graphs, fragmentation
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    ep_sizes: Optional[tuple[int, ...]] = None  # None: every power of two that fits memory
    batch_grid: tuple[float, ...] = field(default_factory=lambda: geometry(1, 16384, 4))
    spec: SpecDecode = SpecDecode()
    loop_control: LoopControl = LoopControl.NONE

    def __post_init__(self):
        object.__setattr__(self, "loop_control", LoopControl(self.loop_control))
        if not 0 < self.mem_usable_fraction <= 1:
            raise ValueError("mem_usable_fraction must be in (0, 1]")
        if any(t < 1 for t in self.tp_sizes) or not self.tp_sizes:
            raise ValueError("tp sizes must be >= 1")


@dataclass(frozen=True)
class Case:
    network: Network
    tp: int
    ep: int
    context: int


def max_batch_memory(cfg: ServingConfig, tp: int, ep: int, context: float, spec_decode: bool) -> float:
    """Largest ``b`` (requests per TP group, KV replicated on its GPUs) that fits one GPU's memory."""
    m = cfg.model
    extra = cfg.spec.num_draft * m.hidden * m.hidden if spec_decode else 0.0  # draft heads
    free = cfg.mem_capacity * cfg.mem_usable_fraction - m.weight_bytes_per_gpu(tp, ep, extra)
    return max(0.0, np.floor(free / (context * m.kv_bytes_per_token())))


def _ep_options(cfg: ServingConfig, n: int) -> list[int]:
    m = cfg.model
    if cfg.ep_sizes is not None:
        return [e for e in cfg.ep_sizes if n % e == 0 and m.num_experts % e == 0]
    out, e = [], 1
    while e <= n:
        if n % e == 0 and m.num_experts % e == 0:
            out.append(e)
        e *= 2
    return out


def cases_for(network: Network, contexts: Sequence[int], cfg: ServingConfig) -> list[Case]:
    """All (tp, ep) layouts that tile ``network`` and leave room for at least one request."""
    out = []
    for tp in cfg.tp_sizes:
        if network.num_xpus % tp:
            continue
        for ep in _ep_options(cfg, network.num_xpus):
            if ep < tp:
                continue
            for ctx in contexts:
                if max_batch_memory(cfg, tp, ep, ctx, True) >= 1:
                    out.append(Case(network, tp, ep, int(ctx)))
    return out


def _compute_ops(table: ProfileTable, m: ModelShape, tp, ep, ctx, b, q, variant: Variant) -> dict:
    """Per-op compute seconds; ``tp, ep, ctx`` are ``[C, 1]``, ``b`` is ``[C, B]`` or ``[1, B]``."""
    tok = b * q
    tok_moe = tok / tp
    s = table.seconds
    attn = (s(LayerKind.ELEMENTWISE, tokens=tok) + s(LayerKind.MLA_PROJ, tokens=tok, tp=tp)
            + s(LayerKind.MLA_CORE, requests=b, ctx=ctx, q_len=q, tp=tp))  # fmt: skip
    pre = s(LayerKind.ROUTER, tokens=tok_moe)
    experts = (s(LayerKind.MOE_EXPERTS, routed_tokens=tok_moe * m.top_k, experts=m.num_experts / ep)
               + s(LayerKind.SHARED_EXPERT, tokens=tok_moe))  # fmt: skip
    post = np.zeros_like(attn)
    if variant.bigmac_ratio < 1:
        proj = s(LayerKind.LATENT_PROJ, tokens=tok_moe, latent=variant.bigmac_ratio * m.hidden)
        pre, post = pre + proj, proj
    return {
        "attn": attn,
        "pre": pre,
        "experts": experts,
        "post": post,
        "dense_ffn": s(LayerKind.DENSE_FFN, tokens=tok, tp=tp),
        "head": s(LayerKind.LM_HEAD, tokens=tok, tp=tp),
    }


def _lines(network: Network, op: Collective, group: int) -> np.ndarray:
    """``[J, 4]`` (intercept, slope, concurrent intercept, concurrent slope) per algorithm."""
    rows = []
    for a in algorithms(network, op, group):
        c = a.concurrent
        rows.append((a.intercept, a.slope, c.intercept if c else -np.inf, c.slope if c else 0.0))
    return np.array(rows or [(0.0, 0.0, -np.inf, 0.0)])


def _stack_lines(per_case: list[np.ndarray]) -> np.ndarray:
    """Pad to ``[C, J, 4]`` with lines that never win."""
    j = max(x.shape[0] for x in per_case)
    out = np.tile(np.array([np.inf, 0.0, -np.inf, 0.0]), (len(per_case), j, 1))
    for i, x in enumerate(per_case):
        out[i, : x.shape[0]] = x
    return out


def _line_time(lines: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """min over algorithms of max(a + c M, a2 + c2 M); lines ``[C, J, 4]``, nbytes ``[C, B]``."""
    nb = nbytes[:, None, :]
    t = np.maximum(lines[..., 0:1] + lines[..., 1:2] * nb, lines[..., 2:3] + lines[..., 3:4] * nb)
    return np.where(nbytes > 0, t.min(axis=1), 0.0)


@dataclass
class _CommLines:
    ar: np.ndarray
    a2a: np.ndarray


def _comm_ops(m: ModelShape, lines: _CommLines, tp, ep, b, q, variant: Variant) -> dict:
    tok = b * q
    tok_moe = tok / tp
    ar_bytes = np.broadcast_to(tok * m.hidden * m.act_bytes, np.broadcast_shapes(tok.shape, tp.shape))
    remote = np.vectorize(variant.remote_factor)(ep) if variant.has_lar else 1.0
    copies = tok_moe * m.top_k * m.hidden * variant.bigmac_ratio * remote
    shape = np.broadcast_shapes(ar_bytes.shape, np.shape(copies))
    return {
        "ar": _line_time(lines.ar, np.broadcast_to(ar_bytes, shape)),
        "dispatch": _line_time(lines.a2a, np.broadcast_to(copies * m.dispatch_bytes, shape)),
        "combine": _line_time(lines.a2a, np.broadcast_to(copies * m.combine_bytes, shape)),
    }


def control_seconds(cases: Sequence[Case], control: LoopControl) -> np.ndarray:
    """``[C, 1]`` seconds of one loop iteration's control exchange per case (:class:`LoopControl`)."""
    if LoopControl(control) is LoopControl.NONE:
        return np.zeros((len(cases), 1))
    cache: dict = {}
    for c in cases:
        key = (c.network, c.ep)
        if key not in cache:
            lines = _lines(c.network, Collective.ALL_REDUCE, c.ep)[None]
            one = float(_line_time(lines, np.array([[CONTROL_BYTES]], dtype=float))[0, 0])
            cache[key] = 2 * one if c.ep > 1 else 0.0
    return np.array([[cache[(c.network, c.ep)]] for c in cases])


def decode_ops(m: ModelShape) -> list[tuple[str, int]]:
    """The step's op chain as ``(op name, lane)``; alternates lanes (see the module docstring)."""
    ops: list[tuple[str, int]] = []
    for _ in range(m.num_dense_layers):
        ops += [("attn", COMPUTE), ("ar", COMM), ("dense_ffn", COMPUTE), ("ar", COMM)]
    for i in range(m.num_moe_layers):
        first = i == 0
        ops += [("attn" if first else "post+attn", COMPUTE), ("ar", COMM), ("pre", COMPUTE),
                ("dispatch", COMM), ("experts", COMPUTE), ("combine", COMM)]  # fmt: skip
    ops.append(("post+head" if m.num_moe_layers else "head", COMPUTE))
    return ops


def _step_time(m: ModelShape, comp: dict, comm: dict, num_microbatches: int, variant: Variant) -> np.ndarray:
    d = {**comp, **comm}
    d["post+attn"] = comp["post"] + comp["attn"]
    d["post+head"] = comp["post"] + comp["head"]
    ops = decode_ops(m)
    f = variant.farskip_overlap
    if num_microbatches == 1 and f == 0:  # plain sum, same as the one-micro-batch schedule
        total = np.zeros(np.broadcast_shapes(*(np.shape(v) for v in d.values())))
        for name, _ in ops:
            total = total + d[name]
        return total
    hidden = [f if name in ("dispatch", "combine") else 0.0 for name, _ in ops]
    return greedy_schedule([lane for _, lane in ops], [d[name] for name, _ in ops], num_microbatches, hidden)


@dataclass
class CaseResults:
    """TPOT ``[C, B]`` per technique for ``cases`` over ``batch`` (requests per TP group)."""

    cases: list[Case]
    batch: np.ndarray  # [B]
    tpot: dict[Technique, np.ndarray]
    max_batch: dict[Technique, np.ndarray]  # [C] memory limit (SD adds its draft heads)
    variant: Variant


def evaluate_cases(
    cases: Sequence[Case],
    cfg: ServingConfig = ServingConfig(),
    variant: Variant = BASELINE,
    techniques: Sequence[Technique] = tuple(Technique),
    table: Optional[ProfileTable] = None,
) -> CaseResults:
    """TPOT of every case at every batch size of ``cfg.batch_grid`` under each technique."""
    table = table or default_table()
    m = cfg.model
    cases = list(cases)
    if not cases:
        raise ValueError("no serving layouts fit (memory too small for the model?)")
    b = np.asarray(cfg.batch_grid, dtype=float)[None, :]
    tp = np.array([c.tp for c in cases], dtype=float)[:, None]
    ep = np.array([c.ep for c in cases], dtype=float)[:, None]
    ctx = np.array([c.context for c in cases], dtype=float)[:, None]

    # compute depends on (tp, ep, context) only: evaluate unique combinations, then gather
    keys = [(c.tp, c.ep, c.context) for c in cases]
    uniq = sorted(set(keys))
    u_idx = np.array([uniq.index(k) for k in keys])
    u_tp, u_ep, u_ctx = (np.array([k[i] for k in uniq], dtype=float)[:, None] for i in range(3))

    # communication depends on (network, tp, ep): algorithm lines per case
    line_cache: dict = {}

    def lines_for(c: Case) -> _CommLines:
        key = (c.network, c.tp, c.ep)
        if key not in line_cache:
            line_cache[key] = (_lines(c.network, Collective.ALL_REDUCE, c.tp), _lines(c.network, Collective.ALL_TO_ALL, c.ep))
        return line_cache[key]

    per = [lines_for(c) for c in cases]
    lines = _CommLines(_stack_lines([p[0] for p in per]), _stack_lines([p[1] for p in per]))

    sd = cfg.spec
    q_ver = sd.num_draft + 1
    needed = {}  # (num_microbatches, q) -> step time [C, B]
    wants = set()
    for t in techniques:
        t = Technique(t)
        nmb = 2 if t in (Technique.DBO, Technique.DBO_SD) else 1
        if t in (Technique.SD, Technique.DBO_SD):
            wants.add((nmb, q_ver))
            if sd.draft_cost == DraftCost.DECODE_STEP:
                wants.add((nmb, 1))
        else:
            wants.add((nmb, 1))
    for nmb, q in sorted(wants):
        bm = b / nmb
        comp_u = _compute_ops(table, m, u_tp, u_ep, u_ctx, bm, q, variant)
        comp = {k: v[u_idx] for k, v in comp_u.items()}
        comm = _comm_ops(m, lines, tp, ep, bm, q, variant)
        needed[(nmb, q)] = _step_time(m, comp, comm, nmb, variant)

    control = control_seconds(cases, cfg.loop_control)  # once per loop iteration (a cycle under SD)
    tpot, mb = {}, {}
    for t in techniques:
        t = Technique(t)
        nmb = 2 if t in (Technique.DBO, Technique.DBO_SD) else 1
        if t in (Technique.SD, Technique.DBO_SD):
            draft = needed[(nmb, 1)] if sd.draft_cost == DraftCost.DECODE_STEP else 0.0
            tpot[t] = (draft + needed[(nmb, q_ver)] + control) / sd.tokens_per_cycle
            spec = True
        else:
            tpot[t] = needed[(nmb, 1)] + control
            spec = False
        mb[t] = np.array([max_batch_memory(cfg, c.tp, c.ep, c.context, spec) for c in cases])
    return CaseResults(cases, b[0], tpot, mb, variant)


def _best_in_grid(batch: np.ndarray, tpot: np.ndarray, slo: float, cap: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per case: the largest-throughput batch with ``TPOT <= slo`` and ``b <= cap``.

    Between grid points TPOT is interpolated linearly, so the answer is not limited to the grid:
    the SLO crossing and the memory cap (both floored to whole requests) are candidates too.
    Returns ``(throughput_per_group = b / TPOT, b, TPOT)``, each ``[C]``; zeros where nothing fits.
    """
    c_n = tpot.shape[0]
    r = np.arange(c_n)

    def interp(bq: np.ndarray) -> np.ndarray:  # TPOT at batch bq [C, K] on each case's curve
        j = np.clip(np.searchsorted(batch, bq, side="right") - 1, 0, len(batch) - 2)
        lo, hi = batch[j], batch[j + 1]
        t0, t1 = tpot[r[:, None], j], tpot[r[:, None], j + 1]
        return t0 + (np.clip(bq, batch[0], batch[-1]) - lo) / (hi - lo) * (t1 - t0)

    lo, hi = batch[:-1], batch[1:]
    t0, t1 = tpot[:, :-1], tpot[:, 1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = np.clip((slo - t0) / (t1 - t0), 0.0, 1.0)
    cross = np.where((t0 <= slo) & (t1 > slo), np.floor(lo + frac * (hi - lo)), np.nan)
    capb = np.floor(cap)[:, None].astype(float)
    bb = np.concatenate([np.broadcast_to(batch, tpot.shape), cross, capb], axis=1)
    bb = np.where((bb <= cap[:, None]) & (bb >= 1) & (bb <= batch[-1]), bb, np.nan)
    tt = np.concatenate([tpot, interp(np.nan_to_num(cross, nan=1.0)), interp(np.minimum(capb, batch[-1]))], axis=1)
    feasible = ~np.isnan(bb) & (tt <= slo * (1 + 1e-12))
    thr = np.where(feasible, np.nan_to_num(bb) / np.where(feasible, tt, 1.0), 0.0)
    j = np.argmax(thr, axis=1)
    best = thr[r, j]
    return best, np.where(best > 0, bb[r, j], 0.0), np.where(best > 0, tt[r, j], np.nan)


def best_under_slo(res: CaseResults, slo: float, optimization: Optimization | str) -> dict:
    """Per case, the best technique allowed by ``optimization`` under TPOT <= ``slo``.

    Returns arrays ``[C]``: ``throughput_per_xpu`` (tokens/s), ``batch`` (requests per TP group),
    ``tpot`` (s), ``technique`` (names).
    """
    opt = Optimization(optimization)
    out_thr = np.zeros(len(res.cases))
    out_b = np.zeros(len(res.cases))
    out_t = np.full(len(res.cases), np.nan)
    out_tech = np.full(len(res.cases), "", dtype=object)
    tp = np.array([c.tp for c in res.cases], dtype=float)
    for t in OPTIMIZATION_TECHNIQUES[opt]:
        if t not in res.tpot:
            raise ValueError(f"technique {t.value} was not evaluated")
        thr, bb, tt = _best_in_grid(res.batch, res.tpot[t], slo, res.max_batch[t])
        thr = thr / tp
        better = thr > out_thr
        out_thr = np.where(better, thr, out_thr)
        out_b = np.where(better, bb, out_b)
        out_t = np.where(better, tt, out_t)
        out_tech = np.where(better, t.value, out_tech)
    return {"throughput_per_xpu": out_thr, "batch": out_b, "tpot": out_t, "technique": out_tech}
