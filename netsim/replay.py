"""Predict a measured serving run: the project's server replayed step by step on the fitted network.

``bench_serve.py`` serves a model on ``R`` expert-parallel ranks over a shaped link and records
every request (arrival, prompt and output tokens, TTFT, end-to-end time). This module predicts
those figures from two inputs measured elsewhere:

* the **network**: alpha-beta constants fitted to this machine's collectives
  (``python -m netsim fit``, e.g. ``examples/netsim/gloo_netns_fit.json``) at the run's link rate;
* the **compute** of the served model, per variant (``scripts/profile_serving_compute.py``: engine
  steps timed on loopback, so without the shaped link): one step on a rank costs
  ``fixed + per_token x tokens + per_request x requests`` seconds (tokens as the engine pads
  them), an idle rank's dummy forward ``dummy``, a step sends ``a2a_bytes_per_token x tokens``
  off-rank in ``a2a_calls`` all-to-alls, and the serving loop's own exchange costs ``loop``.

The replay follows the serving loop (``megatron.inference.loop``) and megatron-core's dynamic
engine as this project drives them. Every iteration all ranks run the loop's control collectives
(a broadcast of the new requests and an all-gather of the last step's tokens, two small
collectives each: their profiled cost on loopback plus four latencies of the link), then step in lockstep: each rank's engine batches one decode token per running
request plus prefill chunks of waiting requests (first come, first served) up to
``max_batch_tokens`` tokens and ``max_requests`` requests, padded as the engine pads them
(``Engine.padded``); ranks without work run the dummy forward while another rank works. The step lasts as long as its slowest rank's compute plus its
all-to-alls, each sized by the busiest rank. A request arriving during an iteration joins at the
next one, on the rank the run recorded for it (the server's ``x-dp-rank`` header, e.g. Sem-MoE's
Algorithm 2) or else the rank round-robin gives it; the token a step produces reaches the client one
control phase later. TTFT is arrival to first token; TPOT the mean gap between its later tokens.

With a link table (``--link-table``, replay/4) the all-to-alls are timed from calibrations of the
run's own link instead (``LinkTable``, ``step_all_to_all_s``): the shaper's bucket and TCP make a call's
time depend on its size, on the rest its link had and on whether the link carries traffic both ways.
A tensor-parallel run (TP = EP = the ranks: one engine whose ranks all hold its tokens, replay/6)
needs the table: its attention and embedding all-reduces and logit all-gathers cross the same links.

What it leaves out: HTTP and tokenizer time, Python jitter and host contention (2 ranks share
2 cores with the client here: the served steps' compute runs 15-20% above the profile's), the
engine's memory limits (the benchmark's KV cache never fills).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

from .collectives import AlphaBeta

__all__ = ["StepProfile", "Link", "LinkTable", "Engine", "Request", "simulate", "step_all_to_all_s", "rest_links",
           "step_calls", "compute_gaps",
           "fit_all_to_all_s", "dispatch_flows",
           "phase_figures", "FIGURES", "MODEL_VERSION",
           "model_fingerprint", "offered_load_bound"]

FIGURES = ("ttft_p50_s", "tpot_p50_s", "output_tokens_per_s")

# The replay model's version. A validation is out of sample only for runs measured after the model
# it names was fixed: change this (and say what changed in docs/netsim.md) whenever the replay's
# arithmetic changes; ``validate`` prints it with ``model_fingerprint()`` of this file.
MODEL_VERSION = "replay/7 (2026-11-27)"
# /3: requests go to the engine the run recorded (x-dp-rank), if it did.
# /4: with a link table (``LinkTable``: all-to-alls calibrated at the run's rate after rests of 0-80 ms, both ways
#     and one way), each dispatch and combine costs what the link measured for its size, its direction mix and the
#     rest its rank link had (each direction of each rank link rests on its own); the metadata exchange costs the
#     link's latency; the compute lies around the calls as the profile measured (``compute_before``/``_after``);
#     each iteration costs the real serving loop's profiled overhead (``iteration_s``) when the profile has it.
# /5: a call spends only the rest its bytes take at the link rate (the shaper's bucket, at most ``bucket_s``),
#     instead of every call with traffic emptying it: the light direction of a lopsided call keeps its bucket.
# /6: tensor parallelism at TP = EP = the ranks (one engine): every TP rank dispatches the engine's tokens, and the
#     profiled TP all-reduces and logit all-gathers cost what the link table's all-reduce (and all-to-all)
#     calibrations measured, in their places in the step; attention-DP runs replay as in /5.
# /7: a call costs the calibration's mean time, not its median (a step is a sum of calls; small calls' times are
#     skewed); the probabilities' exchange follows the dispatch (the order the spans show); where the profile
#     measured it, the compute lies between the calls as measured per kind of step (``compute_gaps``).

# A rate whose measured request rate is at least this fraction of the offered rate is bound by
# the offered load (the server keeps up): its throughput says nothing about the model.
OFFERED_LOAD_FRACTION = 0.8


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """Compute of one engine step on one rank (seconds) and its all-to-all traffic."""

    fixed_s: float
    per_token_s: float
    per_request_s: float
    dummy_s: float
    a2a_bytes_per_token: float  # off-rank bytes a rank sends per token it holds (all layers and calls)
    a2a_calls: int  # all-to-alls per step (dispatch, combine and routing metadata of every MoE layer)
    loop_s: float = 0.0  # the serving loop's own work per iteration (its object collectives on loopback)
    iteration_s: float = 0.0  # the real serving loop's overhead per iteration outside forwards (replaces loop_s)
    compute_before: Optional[float] = None  # share of a step's compute before its first all-to-all (None: even)
    compute_after: Optional[float] = None  # and after its last
    tp: int = 1  # ranks per engine (tensor parallelism): each holds the engine's tokens and dispatches them all
    tp_allreduces: int = 0  # TP all-reduces per step (the embedding's, each attention output's) ...
    tp_allreduce_bytes_per_token: float = 0.0  # ... each of this x the step's tokens on every TP rank
    tp_gathers: int = 0  # TP all-gathers per step (the output layer's logits) ...
    tp_gather_bytes_per_request: float = 0.0  # ... each of this x the step's requests in from every TP rank
    layout_decode: Optional[tuple] = None  # shares of a decode step's compute around its calls (compute_gaps)
    layout_prefill: Optional[tuple] = None  # and of a step with prefill tokens

    @property
    def control_s(self) -> float:
        """The loop's own seconds per iteration on loopback: the profiled whole-loop overhead when there."""
        return self.iteration_s or self.loop_s

    def compute_s(self, tokens: int, requests: int) -> float:
        return self.fixed_s + self.per_token_s * tokens + self.per_request_s * requests

    @classmethod
    def from_dict(cls, d: dict) -> StepProfile:
        try:
            return cls(*(float(d[k]) for k in ("fixed_s", "per_token_s", "per_request_s", "dummy_s",
                                               "a2a_bytes_per_token")), int(d["a2a_calls"]),
                       float(d.get("loop_s", 0.0)), float(d.get("iteration_s", 0.0)),
                       *(None if d.get(k) is None else float(d[k]) for k in ("compute_before", "compute_after")),
                       int(d.get("tp", 1)), int(d.get("tp_allreduces", 0)), float(d.get("tp_allreduce_bytes_per_token", 0.0)),
                       int(d.get("tp_gathers", 0)), float(d.get("tp_gather_bytes_per_request", 0.0)),
                       *(None if d.get(k) is None else tuple(float(x) for x in d[k])
                         for k in ("layout_decode", "layout_prefill")))
        except KeyError as e:
            raise ValueError(f"step profile: missing key {e.args[0]!r}") from None


@dataclasses.dataclass(frozen=True)
class Link:
    """A flat switch of ``ranks`` ranks at ``gbit`` per rank link with fitted constants. The shaper
    is a token bucket of ``burst_bytes``: bytes covered by the bucket pass at memory speed, the rest
    at the link rate, and the bucket refills at the link rate while the link is idle (so back-to-back
    all-to-alls of one step share one bucket; the fit saw every call start with a full one)."""

    ranks: int
    gbit: float
    constants: AlphaBeta
    burst_bytes: float = 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.gbit * 1e9 / 8

    def latency_s(self) -> float:
        c = self.constants
        return c.alpha0 + c.alpha_round + (self.ranks - 1) * c.alpha_dest

    def all_to_all_s(self, bytes_per_rank: float, bucket: float) -> tuple:
        """One all-to-all (gloo's pairwise exchange) where the busiest rank sends ``bytes_per_rank``
        off-rank, with ``bucket`` bytes of burst available: ``(seconds, bucket left)``."""
        if self.ranks < 2:
            return 0.0, bucket
        shaped = max(0.0, bytes_per_rank - bucket)
        return self.latency_s() + shaped / self.bytes_per_s / self.constants.utilization, \
            max(0.0, bucket - bytes_per_rank)

    def refill(self, bucket: float, idle_s: float) -> float:
        return min(self.burst_bytes, bucket + idle_s * self.bytes_per_s)

    def control_s(self) -> float:
        """The loop's broadcast and all-gather of small pickled objects (size, then payload: four
        collectives of a few hundred bytes)."""
        if self.ranks < 2:
            return 0.0
        return 4 * self.latency_s()


@dataclasses.dataclass(frozen=True)
class LinkTable:
    """All-to-all seconds measured on the run's own link: ``scripts/bench_ep.py --collectives`` at the
    run's rate, once per idle gap before each call (``--gap-ms``), both ways (every rank sends) and,
    optionally, one way (``--one-way``: only rank 0 sends). The shaper (``tc tbf``, its bucket at
    least 64 KiB) and TCP make a call's time depend on its size, on how long the link rested before
    it, and on whether the link also carries traffic the other way, in ways one line through
    back-to-back calls misses. On the 0.0665 Gbit/s link: 64 KiB off-rank takes 8 ms back to back
    and under 1 ms after a 10 ms rest; 256 KiB and more run at the nominal rate one way and at about
    half of it both ways. ``gaps_s[i]`` has the curve ``curves[i]`` (both ways) of
    (off-rank bytes a rank sends, seconds), sorted by bytes; ``one_way_gaps_s``/``one_way_curves``
    the same for one way (empty: every call is timed as both ways); ``allreduce_*`` gloo
    all-reduces of a tensor of so many bytes on every rank (a tensor-parallel run's reductions)."""

    ranks: int
    gbit: float
    gaps_s: tuple
    curves: tuple
    one_way_gaps_s: tuple = ()
    one_way_curves: tuple = ()
    allreduce_gaps_s: tuple = ()  # all-reduces (``--ops all_reduce``): (tensor bytes, seconds) per gap
    allreduce_curves: tuple = ()

    @property
    def smallest_bytes(self) -> float:
        return self.curves[0][0][0]

    @property
    def bytes_per_s(self) -> float:
        return self.gbit * 1e9 / 8

    @property
    def bucket_s(self) -> float:
        """Seconds of rest that fill the shaper's bucket: ``tools/bench/netns.py`` gives ``tc tbf`` a
        burst of 64 KiB plus one frame, or 1 ms of traffic where that is more."""
        return max(64 * 1024 + 1514, self.bytes_per_s / 1000) / self.bytes_per_s

    def seconds(self, sent: float, received: float, gap_s: float) -> float:
        """One call whose busiest link carries ``sent`` bytes one way and ``received`` the other,
        after ``gap_s`` of rest: log-log interpolation in bytes (below the smallest size its time,
        above the largest that size's rate), linear in the gap between measured gaps (clamped), and
        linear between the one-way and both-ways times in ``min/max`` of the two directions."""
        hi, lo = max(sent, received), min(sent, received)
        if hi <= 0 or self.ranks < 2:
            return 0.0
        both = float(np.interp(gap_s, self.gaps_s, [self._curve(c, hi) for c in self.curves]))
        if not self.one_way_curves:
            return both
        one = float(np.interp(gap_s, self.one_way_gaps_s, [self._curve(c, hi) for c in self.one_way_curves]))
        return one + (both - one) * lo / hi

    def allreduce_seconds(self, tensor_bytes: float, gap_s: float) -> float:
        """One all-reduce of ``tensor_bytes`` on every rank after ``gap_s`` of rest (interpolated as
        ``seconds``); a one-line error when the table has no all-reduce calibration."""
        if tensor_bytes <= 0 or self.ranks < 2:
            return 0.0
        if not self.allreduce_curves:
            raise ValueError("--link-table: the run's tensor-parallel all-reduces need all_reduce calibrations "
                             "(scripts/calibrate_link_table.sh writes ar_both_*.csv)")
        return float(np.interp(gap_s, self.allreduce_gaps_s, [self._curve(c, tensor_bytes) for c in self.allreduce_curves]))

    @staticmethod
    def _curve(curve, m: float) -> float:
        xs, ys = [b for b, _ in curve], [t for _, t in curve]
        if m <= xs[0]:
            return ys[0]
        if m >= xs[-1]:
            return ys[-1] * m / xs[-1]
        return float(np.exp(np.interp(math.log(m), np.log(xs), np.log(ys))))

    @classmethod
    def from_calibrations(cls, paths: Sequence[str]) -> LinkTable:
        """Read ``bench_ep.py --collectives`` CSVs (all_to_all or all_reduce rows of one rank count)
        with their sidecar JSONs (link rate, gap, one way or not). A call's time is the mean over the
        calibration's repeats where the sidecar has it (replay/7), else the CSV's median: a step
        costs the sum of its calls, and small calls' times are skewed (at 0.08 Gbit/s after 5 ms
        rests, 8 KiB took 0.42 ms in the median and 1.14 ms on average). One-line errors for what
        does not fit."""
        import csv
        import json
        import os

        ranks, gbit, tables = None, None, {}
        for path in paths:
            side = os.path.splitext(path)[0] + ".json"
            try:
                with open(side) as f:
                    meta = json.load(f)
                with open(path, newline="") as f:
                    rows = [r for r in csv.DictReader(f) if r.get("op") in ("all_to_all", "all_reduce")]
                g, gap, one_way = float(meta["link"]["gbit"]), float(meta.get("gap_s", 0.0)), bool(meta.get("one_way"))
                counts, ops = {int(r["ranks"]) for r in rows}, {r["op"] for r in rows}
                kind = "all_reduce" if ops == {"all_reduce"} else "one-way" if one_way else "both-ways"
                share = (lambda n: 1.0) if kind == "all_reduce" else (lambda n: (n - 1) / n)  # off-rank bytes
                means = {(m["op"], int(m["bytes"])): float(m["mean_s"]) for m in meta.get("rows", []) if "mean_s" in m}
                curve = tuple(sorted((int(r["bytes"]) * share(int(r["ranks"])),
                                      means.get((r["op"], int(r["bytes"])), float(r["seconds"]))) for r in rows))
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ValueError(f"--link-table {path}: not a bench_ep.py --collectives CSV with its sidecar JSON "
                                 f"({err})") from None
            if len(counts) != 1 or len(ops) != 1 or len(curve) < 2:
                raise ValueError(f"--link-table {path}: needs all_to_all or all_reduce rows (not both) of one rank "
                                 "count at two sizes or more")
            count = counts.pop()
            if ranks is not None and (count != ranks or not math.isclose(g, gbit, rel_tol=1e-3)):
                raise ValueError(f"--link-table {path}: {count} ranks at {g:g} Gbit/s; the others are "
                                 f"{ranks} ranks at {gbit:g} Gbit/s")
            if (kind, gap) in tables:
                raise ValueError(f"--link-table {path}: a second {kind} table for the gap {gap * 1e3:g} ms")
            ranks, gbit = count, g
            tables[(kind, gap)] = curve

        def gaps(kind):
            return sorted(gap for k, gap in tables if k == kind)

        if not gaps("both-ways"):
            raise ValueError("--link-table: no both-ways all_to_all calibration (without --one-way) given")
        return cls(ranks, gbit, *((tuple(gaps(k)), tuple(tables[(k, g)] for g in gaps(k)))[i]
                                  for k in ("both-ways", "one-way", "all_reduce") for i in (0, 1)))


@dataclasses.dataclass(frozen=True)
class Engine:
    """The engine's sizes per rank. megatron-core's ``DynamicInferenceContext`` (without CUDA graphs)
    forwards a step's tokens padded up to a multiple of ``token_rounder`` (its ``TOKEN_ROUNDER``,
    64), a decode-only step to ``min(max_batch_tokens, max_requests, that)``; it rounds
    ``max_requests`` down to a multiple of 4 (``REQUEST_ROUNDER``)."""

    ranks: int
    max_batch_tokens: int
    max_requests: int
    token_rounder: int = 64

    def padded(self, tokens: int, decode_only: bool) -> int:
        up = -(-tokens // self.token_rounder) * self.token_rounder
        return min(self.max_batch_tokens, self.max_requests, up) if decode_only else up


@dataclasses.dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    rank: Optional[int] = None  # the engine the run gave it (None: round-robin, as the loop's default)


@dataclasses.dataclass
class _Live:
    index: int
    req: Request
    prefilled: int = 0  # prompt tokens already forwarded
    generated: int = 0
    first_s: float = math.nan
    last_s: float = math.nan


def simulate(requests: Sequence[Request], engine: Engine, profile: StepProfile, link: Link,
             table: Optional[LinkTable] = None) -> list:
    """Per request ``(ttft_s, e2e_s, output_tokens)`` in the order given (see the module docstring).
    With ``table`` the all-to-alls cost what the link table measured (``step_all_to_all_s``)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    arrivals = collections.deque(order)
    waiting = [collections.deque() for _ in range(engine.ranks)]
    active: list = [[] for _ in range(engine.ranks)]
    done: dict = {}
    turn = 0
    t = 0.0
    ctrl = profile.control_s + link.control_s()
    bucket = link.burst_bytes
    rest = [[math.inf, math.inf] for _ in range(engine.ranks * profile.tp)]  # seconds each rank link's directions rested
    while len(done) < len(requests):
        rest_links(rest, ctrl)
        if not any(waiting) and not any(active):
            idle = max(0.0, requests[arrivals[0]].arrival_s - t)
            bucket = link.refill(bucket, idle)
            rest_links(rest, idle)
            t = max(t, requests[arrivals[0]].arrival_s)
        while arrivals and requests[arrivals[0]].arrival_s <= t:
            i = arrivals.popleft()
            rank = requests[i].rank
            if rank is None:
                rank, turn = turn, (turn + 1) % engine.ranks
            waiting[rank].append(_Live(i, requests[i]))
        t += ctrl
        bucket = link.refill(bucket, ctrl)
        tokens, reqs, padded, produced = [0] * engine.ranks, [0] * engine.ranks, [0] * engine.ranks, []
        decode_only = True
        for r in range(engine.ranks):
            decoding = [x for x in active[r] if x.prefilled == x.req.prompt_tokens]
            budget = engine.max_batch_tokens - len(decoding)
            tokens[r] += len(decoding)
            produced += decoding
            for x in [x for x in active[r] if x.prefilled < x.req.prompt_tokens]:  # a chunked prefill goes on
                chunk = min(budget, x.req.prompt_tokens - x.prefilled)
                x.prefilled += chunk
                budget -= chunk
                tokens[r] += chunk
                if x.prefilled == x.req.prompt_tokens:
                    produced.append(x)
            while waiting[r] and budget > 0 and len(active[r]) < engine.max_requests:
                x = waiting[r].popleft()
                active[r].append(x)
                chunk = min(budget, x.req.prompt_tokens)
                x.prefilled = chunk
                budget -= chunk
                tokens[r] += chunk
                if x.prefilled == x.req.prompt_tokens:
                    produced.append(x)
            reqs[r] = len(active[r])
            if tokens[r]:
                padded[r] = engine.padded(tokens[r], decode_only=tokens[r] == len(decoding))
                decode_only = decode_only and tokens[r] == len(decoding)
        if not any(tokens):
            continue
        compute = max(profile.compute_s(n, b) if n else profile.dummy_s for n, b in zip(padded, reqs))
        calls = max(1, profile.a2a_calls)
        t += compute
        if table is not None:  # a TP group's ranks all hold (and dispatch) their engine's tokens
            t += step_all_to_all_s(table, profile, [n for n in padded for _ in range(profile.tp)], compute, rest,
                                   requests=max(reqs), decode=decode_only)
        else:
            seconds, bucket = fit_all_to_all_s(link, profile, max(padded), compute, bucket)
            t += seconds
        seen = t + ctrl  # published by the next iteration's all-gather
        for x in produced:
            x.generated += 1
            if x.generated == 1:
                x.first_s = seen
            x.last_s = seen
            if x.generated >= x.req.output_tokens:
                done[x.index] = (x.first_s - x.req.arrival_s, x.last_s - x.req.arrival_s, x.generated)
        for r in range(engine.ranks):
            active[r] = [x for x in active[r] if x.index not in done]
    return [done[i] for i in range(len(requests))]


def fit_all_to_all_s(link: Link, profile: StepProfile, tokens: int, compute_s: float, bucket: float) -> tuple:
    """A step's all-to-alls on the fitted line (replay/3; no link table): ``profile.a2a_calls``
    equal calls of the busiest rank's ``tokens x a2a_bytes_per_token``, the compute spread evenly
    between them refilling one shared bucket. ``(seconds, bucket left)``."""
    calls = max(1, profile.a2a_calls)
    per_call = tokens * profile.a2a_bytes_per_token / calls
    seconds = 0.0
    for _ in range(profile.a2a_calls):
        bucket = link.refill(bucket, compute_s / calls)
        spent, bucket = link.all_to_all_s(per_call, bucket)
        seconds += spent
    return seconds, bucket


def dispatch_flows(profile: StepProfile, padded: Sequence[int]) -> tuple:
    """``(layers, own, others)`` of a step: its MoE layers (three calls each with the metadata
    exchange, else two), and per rank the off-rank bytes one layer's dispatch sends (``own``: its
    tokens' remote copies) and receives (``others``); the combine is the reverse. ``d``, one layer's
    bytes per token one way, is half the profile's ``a2a_bytes_per_token`` (measured with every rank
    equally busy: both ways over all layers) over the layers."""
    calls, ranks = profile.a2a_calls, len(padded)
    layers = calls // 3 if calls % 3 == 0 else max(1, calls // 2)
    d = profile.a2a_bytes_per_token / (2 * layers)
    total = sum(padded)
    own = [d * n for n in padded]
    others = [d * (total - n) / max(1, ranks - 1) for n in padded]
    return layers, own, others


def step_calls(profile: StepProfile) -> list:
    """The collectives of one engine step, in order: per MoE layer the dispatch, the probabilities'
    exchange right after it (``"meta"``, where the profile counts three calls per layer) and the
    combine; for a tensor-parallel engine also its all-reduces (``"reduce"``: the embedding's at
    the start, the first attention's before the first dispatch, each later attention's before its
    layer's dispatch; more than ``layers + 1``, e.g. a shared expert's, are placed with the first)
    and, at the end, the logits' gathers. This is the order ``serve --a2a-spans`` records."""
    calls = profile.a2a_calls
    with_meta = calls % 3 == 0
    layers = calls // 3 if with_meta else max(1, calls // 2)
    reductions = profile.tp_allreduces if profile.tp > 1 else 0
    between = min(max(0, reductions - 1), layers - 1)  # one before each later layer's dispatch
    ahead = reductions - between  # the embedding's, at the start, and the first attention's
    seq = []
    for layer in range(layers):
        seq += ["reduce"] * (ahead if layer == 0 else int(layer <= between))
        seq += ["dispatch"] + (["meta"] if with_meta else []) + ["combine"]
    return seq + ["gather"] * (profile.tp_gathers if profile.tp > 1 else 0)


def compute_gaps(profile: StepProfile, seq: Sequence[str], decode: bool) -> list:
    """Shares of a step's compute before each call of ``seq`` and after the last (``len(seq) + 1``,
    summing to 1). The profile's measured layout for the kind of step (``layout_decode`` /
    ``layout_prefill``: the experts between a dispatch and its combine take less than the attention
    between a combine and the next dispatch) where it has one of that length; else replay/6's:
    ``compute_before`` before the first dispatch (the embedding's reduction at the start, the other
    reductions ahead after it), ``compute_after`` after the last combine (before the gathers), and
    equal parts before each combine and each later layer's first call (``2 x layers + 1`` equal
    parts without the profiled shares)."""
    layout = profile.layout_decode if decode else profile.layout_prefill
    if layout is not None and len(layout) == len(seq) + 1:
        return list(layout)
    layers = seq.count("dispatch")
    even = 1.0 / (2 * layers + 1)
    first = even if profile.compute_before is None else profile.compute_before
    last = even if profile.compute_after is None else profile.compute_after
    first, last = min(first, 1.0), min(last, 1.0 - min(first, 1.0))
    part = (1.0 - first - last) / max(1, 2 * layers - 1)
    gaps, placed_first = [], False
    for i, kind in enumerate(seq):
        if kind == "gather":
            gaps.append(last if seq[i - 1] == "combine" else 0.0)
        elif kind == "meta":
            gaps.append(0.0)
        elif kind == "combine":
            gaps.append(part)
        elif not placed_first:  # the compute before the first dispatch: after the embedding's reduction
            placed_first = kind == "dispatch" or i > 0
            gaps.append(first if placed_first else 0.0)
        else:  # a later layer's first call (its attention's reduction, or its dispatch)
            gaps.append(part if seq[i - 1] == "combine" else 0.0)
    gaps.append(0.0 if seq[-1] == "gather" else last)
    return gaps


def step_all_to_all_s(table: LinkTable, profile: StepProfile, padded: Sequence[int], compute_s: float,
                      rest: list, requests: int = 0, decode: bool = False) -> float:
    """A step's collectives from the link table (``step_calls``: per MoE layer megatron-core's
    alltoall dispatcher makes the dispatch, where rank r sends its own tokens' remote copies,
    ``d x padded[r]``, and receives the others', the probabilities' exchange, timed as the table's
    smallest message after a long rest (the link's latency), and the combine, the reverse; ``d`` is
    one layer's off-rank bytes per token one way: the profile's ``a2a_bytes_per_token``, measured
    with every rank equally busy, counts both ways over all layers). The step's compute lies
    between the calls as ``compute_gaps`` says. A call lasts as long as its busiest rank link,
    timed with what that link carries each way after the rest its busier direction had: each rank
    link's two directions rest on their own (``rest[r] = [out, in]`` seconds, updated in place), so
    when one rank holds the tokens its dispatches leave on a link that rested through the combine
    before. A rest is the shaper's bucket in seconds of link rate: it fills up to
    ``table.bucket_s``, and a call spends what its bytes take at the link rate (a few KiB of a
    lopsided call's light direction spend little).

    A tensor-parallel engine (``profile.tp`` > 1, TP = EP = the ranks: ``padded`` then has the
    engine's tokens on each of its ranks) adds its TP collectives on the same links (replay/6):
    all-reduces of ``tp_allreduce_bytes_per_token`` x tokens, timed by the table's all-reduce
    calibrations after the links' shorter rest, and the logits' all-gathers (``requests x
    tp_gather_bytes_per_request`` from each rank: an exchange timed like an all-to-all of those
    off-rank bytes). ``decode``: a decode-only step (which measured layout applies)."""
    ranks = len(padded)
    if profile.a2a_calls <= 0 or ranks < 2:
        return 0.0
    layers, own, others = dispatch_flows(profile, padded)
    meta = table.seconds(table.smallest_bytes, table.smallest_bytes, math.inf)  # the link's latency
    rate, full = table.bytes_per_s, table.bucket_s

    def spend(flows, seconds: float) -> float:
        for r, sent in enumerate(flows):
            for way in (0, 1):  # a call spends the rest its bytes take at the link rate; a covered one rests on
                if sent[way] <= 0:
                    rest[r][way] += seconds
                    continue
                credit = min(rest[r][way], full) - sent[way] / rate
                rest[r][way] = credit + seconds if credit >= 0 else 0.0
        return seconds

    def call(flows) -> float:
        return spend(flows, max(table.seconds(out, inn, rest[r][0] if out >= inn else rest[r][1])
                                for r, (out, inn) in enumerate(flows)))

    def one(kind: str) -> float:
        if kind == "dispatch":
            return call(list(zip(own, others)))
        if kind == "combine":
            return call(list(zip(others, own)))
        if kind == "meta":
            rest_links(rest, meta)
            return meta
        if kind == "reduce":  # every rank link carries 2 (n - 1) / n of the tensor each way
            tensor = profile.tp_allreduce_bytes_per_token * padded[0]
            seconds = table.allreduce_seconds(tensor, min(min(r) for r in rest))
            return spend([(2 * (ranks - 1) / ranks * tensor,) * 2] * ranks, seconds)
        gathered = profile.tp_gather_bytes_per_request * requests * (ranks - 1)
        return call([(gathered, gathered)] * ranks)

    seq = step_calls(profile)
    gaps = compute_gaps(profile, seq, decode)
    seconds = 0.0
    for kind, gap in zip(seq, gaps):
        rest_links(rest, compute_s * gap)
        seconds += one(kind)
    rest_links(rest, compute_s * gaps[-1])
    return seconds


def rest_links(rest: list, seconds: float) -> None:
    """Every direction of every rank link rests ``seconds`` more (``rest[r] = [out, in]``)."""
    for link in rest:
        link[0] += seconds
        link[1] += seconds


def phase_figures(ttft: Sequence[float], e2e: Sequence[float], output_tokens: Sequence[int],
                  arrivals: Sequence[float]) -> dict:
    """TTFT and TPOT medians and output tokens/s of one phase (the benchmark's definitions:
    throughput over the phase's start, time 0, to the last completion)."""
    tpot = [(e - f) / (n - 1) for f, e, n in zip(ttft, e2e, output_tokens) if n > 1]
    end = max(a + e for a, e in zip(arrivals, e2e))
    start = 0.0
    return {
        "ttft_p50_s": float(np.median(ttft)),
        "tpot_p50_s": float(np.median(tpot)) if tpot else None,
        "output_tokens_per_s": float(sum(output_tokens) / (end - start)) if end > start else None,
    }


# ---------------------------------------------------------------------------- bench_serve runs


def load_fit(path) -> tuple[AlphaBeta, float]:
    """Constants and token-bucket burst of a ``python -m netsim fit`` JSON."""
    import json

    try:
        with open(path) as f:
            d = json.load(f)
        return AlphaBeta.from_dict(d["constants"]), float(d.get("burst_bytes") or 0.0)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--fit {path}: not a readable netsim fit JSON ({err})") from None


def run_requests(run: dict, variant: str, phase: str) -> list:
    """The requests of one measured phase as the replay's input (actual send times, prompt and
    output lengths): what the client did, not what the server answered. A run of several
    (``bench_serve/2``: one request list per run) replays its first run."""
    requests = run["requests"][variant][phase]
    if run.get("schema") == "bench_serve/2":
        requests = requests[0]
    return [Request(float(r["sent"]), int(r["prompt_tokens"]), max(1, int(r["output_tokens"])), r.get("dp_rank"))
            for r in requests if r["ok"]]


def recorded_assignment(run: dict, variant: str) -> bool:
    """Whether every request of the variant's rate phases records the engine that served it."""
    for phase in rate_phases(run, variant):
        reqs = run["requests"][variant][phase]
        for r in (reqs[0] if run.get("schema") == "bench_serve/2" else reqs):
            if r["ok"] and r.get("dp_rank") is None:
                return False
    return True


def rate_phases(run: dict, variant: str) -> list:
    return [p for p in run["requests"][variant] if p.startswith("rate-")]


def predict_run(run: dict, profiles: dict, constants: AlphaBeta, burst_bytes: float = 0.0,
                table: Optional[LinkTable] = None) -> dict:
    """Predicted ``FIGURES`` per variant and request rate of a bench_serve run (``--mode serve``,
    shaped link). ``profiles``: variant -> profile dict (``scripts/profile_serving_compute.py``).
    Off-rank bytes follow the LAR the run measured: ``bytes x (1 - lar_run) / (1 - lar_profile)``."""
    if run.get("mode") != "serve":
        raise ValueError("only --mode serve runs can be predicted (TTFT, TPOT, throughput under load)")
    net = run["network"]
    if not net.get("shaped"):
        raise ValueError("the run is on unshaped loopback: there is no link to model")
    ranks = int(run["config"]["ranks"])
    tp = int(run["config"].get("tensor_model_parallel_size") or 1)
    ep = int(run["config"].get("expert_model_parallel_size") or ranks)
    if tp > 1 and not (tp == ep == ranks and table is not None):
        raise ValueError(f"the run serves TP {tp} x EP {ep} on {ranks} ranks: the replay models tensor parallelism "
                         "only where TP = EP = the ranks (one engine), with a --link-table (its all-reduces)")
    if run["config"].get("expert_comm", "alltoall") != "alltoall" or (run["config"].get("semmoe_tables") and tp > 1):
        raise ValueError("the replay models all-to-all experts with every TP rank dispatching its copy; not "
                         "--expert-comm allreduce or Sem-MoE's Algorithm 3")
    server = run["config"]["server"]
    engine = Engine(ranks // tp, int(server["max_batch_tokens"]), int(server["max_requests"]) // 4 * 4)
    link = Link(ranks, float(net["link"]["gbit"]), constants, burst_bytes)
    if table is not None and (table.ranks != ranks or not math.isclose(table.gbit, link.gbit, rel_tol=1e-3)):
        raise ValueError(f"the link table was measured with {table.ranks} ranks at {table.gbit:g} Gbit/s; the run "
                         f"served {ranks} ranks at {link.gbit:g} Gbit/s")
    out = {}
    for v in run["config"]["variants"]:
        if v not in profiles:
            raise ValueError(f"the profile has no variant {v!r} (it has {', '.join(profiles)})")
        prof = dict(profiles[v])
        lar_run, lar_prof = run["variants"][v].get("lar"), prof.get("lar")
        if lar_run is not None and lar_prof is not None and lar_prof < 1:
            prof["a2a_bytes_per_token"] *= (1 - lar_run) / (1 - lar_prof)
        step = StepProfile.from_dict(prof)
        if step.tp != tp:
            raise ValueError(f"the profile of {v!r} was taken at TP {step.tp}; the run served TP {tp}")
        out[v] = {}
        for phase in rate_phases(run, v):
            reqs = run_requests(run, v, phase)
            got = simulate(reqs, engine, step, link, table)
            out[v][phase.split("-", 1)[1]] = phase_figures([g[0] for g in got], [g[1] for g in got],
                                                           [g[2] for g in got], [r.arrival_s for r in reqs])
    return out


def model_fingerprint() -> str:
    """The first 12 hex digits of this file's sha256: which replay code produced a prediction."""
    import hashlib

    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


def offered_load_bound(stats: dict) -> bool:
    """Whether a measured rate kept up with its offered load (``requests_per_s`` at least
    ``OFFERED_LOAD_FRACTION`` of ``offered_rate``; an unbounded rate never is): below saturation
    throughput equals the offered load whatever the model predicts."""
    offered, achieved = stats.get("offered_rate"), stats.get("requests_per_s")
    if offered is None or achieved is None or not math.isfinite(float(offered)):
        return False
    return float(achieved) >= OFFERED_LOAD_FRACTION * float(offered)


def measured_figures(stats: dict) -> dict:
    """``FIGURES`` of one measured rate (``variants.<v>.rates.<rate>`` of the run's JSON)."""
    return {"ttft_p50_s": stats["ttft_s"]["p50"], "tpot_p50_s": stats["tpot_s"]["p50"],
            "output_tokens_per_s": stats["output_tokens_per_s"]}


def validate_run(run: dict, predicted: dict) -> dict:
    """Relative error ``(predicted - measured) / measured`` of every figure, and their mean absolute
    per figure. Throughput counts only at rates above saturation (``offered_load_bound`` false):
    below it both sides equal the offered load and would dilute the mean. ``mean_abs_rel_error``
    is over the counted points; ``mean_abs_rel_error_all_points`` counts every point (the figure
    earlier versions reported)."""
    rows, unmodelled = [], {}
    for v, rates in predicted.items():
        scheduler = run["variants"][v].get("request_scheduler")
        if scheduler not in (None, "round-robin") and not recorded_assignment(run, v):
            unmodelled[v] = f"{scheduler} request scheduling (the replay assigns requests round-robin)"
        for rate, pred in rates.items():
            stats = run["variants"][v]["rates"][rate]
            meas = measured_figures(stats)
            bound = offered_load_bound(stats)
            for fig in FIGURES:
                p, m = pred[fig], meas[fig]
                rel = (p - m) / m if p is not None and m else None
                counted = rel is not None and not (fig == "output_tokens_per_s" and bound)
                rows.append({"variant": v, "rate": rate, "figure": fig, "measured": m, "predicted": p,
                             "relative_error": rel, "offered_load_bound": bound, "counted": counted})

    def summary(selected):
        errs = [abs(r["relative_error"]) for r in selected]
        return {"mean_abs_rel_error": float(np.mean(errs)) if errs else None,
                "max_abs_rel_error": float(np.max(errs)) if errs else None, "points": len(errs)}

    counted = [r for r in rows if r["counted"]]
    everything = summary([r for r in rows if r["relative_error"] is not None])
    return {"rows": rows, **summary(counted),
            "by_figure": {fig: summary([r for r in counted if r["figure"] == fig]) for fig in FIGURES},
            "mean_abs_rel_error_all_points": everything["mean_abs_rel_error"], "all_points": everything["points"],
            "unmodelled": unmodelled, "model_version": MODEL_VERSION, "model_fingerprint": model_fingerprint()}
