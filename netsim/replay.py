"""The project's server replayed step by step on the run's calibrated link (``simulate``).

``bench_serve.py`` serves a model on ``R`` expert-parallel ranks over a shaped link and records
every request (arrival, prompt and output tokens, TTFT, end-to-end time). The replay predicts
those figures from inputs measured apart from the run (``netsim.validation`` reads them):

* the **link**: the run's own link calibrated at its rate (``netsim.link_table.LinkTable``:
  all-to-alls after rests of 0-80 ms, both ways and one way, and all-reduces for a
  tensor-parallel run), plus the latency of this machine's fitted collectives
  (``python -m netsim fit``, e.g. ``examples/netsim/gloo_netns_fit.json``);
* the **compute** of the served model, per variant (``scripts/profile_serving_compute.py``: engine
  steps timed on loopback, so without the shaped link): one step on a rank costs
  ``fixed + per_token x tokens + per_request x requests`` seconds (tokens as the engine pads
  them), an idle rank's dummy forward ``dummy``; a step sends ``a2a_bytes_per_token x tokens``
  off-rank in ``a2a_calls`` all-to-alls; its compute lies around its collectives as the profile
  measured per kind of step (``layout_decode``, ``layout_prefill``); the serving loop's own work
  costs ``iteration_s`` per iteration.

The replay follows the serving loop (``megatron.inference.loop``) and megatron-core's dynamic
engine as this project drives them. Every iteration all ranks run the loop's own exchange
(``loop_control_s``: the profiled ``iteration_s`` plus the loop's small collectives, which each
version prices its way: ``MODELS``), then step in lockstep: each rank's engine batches one decode token per running request plus prefill chunks of
waiting requests (first come, first served) up to ``max_batch_tokens`` tokens and
``max_requests`` requests, padded as the engine pads them (``Engine.padded``); ranks without
work run the dummy forward while another rank works. The step lasts as long as its slowest rank's
compute plus its collectives (``step_all_to_all_s``: each call timed by the link table for its
bytes each way on its busiest rank link and the rest that link had). A request arriving during an
iteration joins at the next one, on the rank the run recorded for it (the server's ``x-dp-rank``
header, e.g. Sem-MoE's Algorithm 2) or else the rank round-robin gives it (the loop's default);
the token a step produces reaches the client one control phase later. TTFT is arrival to first
token; TPOT the mean gap between its later tokens. A tensor-parallel run (TP = EP = the ranks:
one engine whose ranks all hold its tokens) adds its attention and embedding all-reduces and
logit all-gathers on the same links.

What it leaves out: the HTTP front end's own time (a thread of rank 0 that shares the interpreter
with the loop), the tails of the loop's exchange beyond the link table's means, Python jitter and
host contention (2 ranks share 2 cores with the client here), the engine's memory limits (the
benchmark's KV cache never fills). ``docs/results/netsim_bias.md`` measures what each costs.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from typing import Optional, Sequence

from .collectives import AlphaBeta
from .link_table import LinkTable

__all__ = ["MODEL_VERSION", "MODELS", "Model", "Control", "model", "loop_control_s", "StepProfile", "Link", "Engine",
           "Request", "simulate", "step_all_to_all_s",
           "rest_links", "step_calls", "dispatch_flows"]

# The replay model's version. A validation is out of sample only for runs measured after the model
# it names was fixed: change this (docs/design/netsim.md, "The replay model") whenever
# the replay's arithmetic changes; ``validate`` prints it with the git commit of the code.
MODEL_VERSION = "replay/8 (2026-12-03)"


class Control(str, enum.Enum):
    """How a version prices the serving loop's own exchange between steps (``_control``)."""

    FITTED = "fitted"
    LINK_TABLE = "link-table"


@dataclasses.dataclass(frozen=True)
class Model:
    """One version of the replay's arithmetic: what differs between versions, so that a result
    reported with an earlier version is still reproduced by it (``MODELS``, ``model``)."""

    version: str
    control: Control

    @property
    def name(self) -> str:
        """The version without its date (``replay/8``)."""
        return self.version.split()[0]


MODELS = {m.version: m for m in (Model("replay/7 (2026-11-27)", Control.FITTED),
                                 Model(MODEL_VERSION, Control.LINK_TABLE))}


def model(version: Optional[str] = None) -> Model:
    """The model of ``version`` (its full string or its name, e.g. ``replay/7``; the current one by
    default); a one-line ``ValueError`` naming the known versions otherwise."""
    if version is None:
        return MODELS[MODEL_VERSION]
    for m in MODELS.values():
        if version in (m.version, m.name):
            return m
    raise ValueError(f"no replay model {version!r} (known: {', '.join(m.name for m in MODELS.values())})")


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """Compute of one engine step on one rank (seconds), its collectives and where its compute lies
    around them. ``layout_decode`` / ``layout_prefill``: the share of a decode (prefill) step's
    compute before each collective of ``step_calls`` and after the last (``len(step_calls) + 1``
    shares summing to one): the experts between a dispatch and its combine take less than the
    attention between a combine and the next dispatch."""

    fixed_s: float
    per_token_s: float
    per_request_s: float
    dummy_s: float
    a2a_bytes_per_token: float  # off-rank bytes a rank sends per token it holds (all layers and calls)
    a2a_calls: int  # all-to-alls per step (dispatch, combine and routing metadata of every MoE layer)
    iteration_s: float  # the serving loop's overhead per iteration outside forwards
    layout_decode: tuple
    layout_prefill: tuple
    tp: int = 1  # ranks per engine (tensor parallelism): each holds the engine's tokens and dispatches them all
    tp_allreduces: int = 0  # TP all-reduces per step (the embedding's, each attention output's) ...
    tp_allreduce_bytes_per_token: float = 0.0  # ... each of this x the step's tokens on every TP rank
    tp_gathers: int = 0  # TP all-gathers per step (the output layer's logits) ...
    tp_gather_bytes_per_request: float = 0.0  # ... each of this x the step's requests in from every TP rank

    def __post_init__(self):
        calls = len(step_calls(self))
        for name in ("layout_decode", "layout_prefill"):
            if len(getattr(self, name)) != calls + 1:
                raise ValueError(f"{name} has {len(getattr(self, name))} shares; this profile's step makes {calls} "
                                 f"collectives, so it needs {calls + 1} (a layout profiled on another model?)")

    def compute_s(self, tokens: int, requests: int) -> float:
        return self.fixed_s + self.per_token_s * tokens + self.per_request_s * requests

    def layout(self, decode: bool) -> tuple:
        """Shares of a step's compute before each of its collectives and after the last."""
        return self.layout_decode if decode else self.layout_prefill

    @classmethod
    def from_dict(cls, d: dict) -> StepProfile:
        """A variant of a ``serving-compute-profile/1`` JSON; a one-line error naming what is missing
        (profiles from before replay/7 lack the layouts: profile the run again)."""
        missing = [k for k in ("fixed_s", "per_token_s", "per_request_s", "dummy_s", "a2a_bytes_per_token",
                               "a2a_calls", "iteration_s", "layout_decode", "layout_prefill") if d.get(k) is None]
        if missing:
            raise ValueError(f"no {', '.join(missing)} (profile the run again with scripts/profile_serving_compute.py)")
        return cls(*(float(d[k]) for k in ("fixed_s", "per_token_s", "per_request_s", "dummy_s",
                                           "a2a_bytes_per_token")), int(d["a2a_calls"]), float(d["iteration_s"]),
                   *(tuple(float(x) for x in d[k]) for k in ("layout_decode", "layout_prefill")),
                   int(d.get("tp", 1)), int(d.get("tp_allreduces", 0)), float(d.get("tp_allreduce_bytes_per_token", 0.0)),
                   int(d.get("tp_gathers", 0)), float(d.get("tp_gather_bytes_per_request", 0.0)))


@dataclasses.dataclass(frozen=True)
class Link:
    """The latency of ``ranks`` ranks' small collectives, from fitted constants: what the serving
    loop's control exchange costs on the link beyond its profiled work."""

    ranks: int
    constants: AlphaBeta

    def latency_s(self) -> float:
        c = self.constants
        return c.alpha0 + c.alpha_round + (self.ranks - 1) * c.alpha_dest

    def control_s(self) -> float:
        """The loop's broadcast and all-gather of small pickled objects (size, then payload: four
        collectives of a few hundred bytes)."""
        if self.ranks < 2:
            return 0.0
        return 4 * self.latency_s()


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
             table: LinkTable, model: Optional[Model] = None, stats: Optional[dict] = None) -> list:
    """Per request ``(ttft_s, e2e_s, output_tokens)`` in the order given (see the module docstring);
    ``model``: the version's arithmetic (``MODELS``; the current ``MODEL_VERSION`` by default).
    ``stats``, if given, gets the replayed totals added: ``steps``, ``busy_s`` (their compute and
    collectives: what the server counts as ``engine_busy_s``) and ``loop_s`` (the loop's exchange
    of the iterations that stepped)."""
    model = model or MODELS[MODEL_VERSION]
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    arrivals = collections.deque(order)
    waiting = [collections.deque() for _ in range(engine.ranks)]
    active: list = [[] for _ in range(engine.ranks)]
    done: dict = {}
    turn = 0
    t = 0.0
    costs = {(a, p): loop_control_s(model, profile, link, table, a, p) for a in (False, True) for p in (False, True)}

    def control(arrived: bool, produced: bool) -> float:
        return costs[arrived, produced]

    produced: list = []
    rest = [[math.inf, math.inf] for _ in range(engine.ranks * profile.tp)]  # seconds each rank link's directions rested
    while len(done) < len(requests):
        if model.control is Control.FITTED:  # the same every iteration: the links rest through it first
            rest_links(rest, control(False, False))
        if not any(waiting) and not any(active):
            idle = max(0.0, requests[arrivals[0]].arrival_s - t)
            rest_links(rest, idle)
            t = max(t, requests[arrivals[0]].arrival_s)
            produced = []  # published before the loop went idle
        arrived = False
        while arrivals and requests[arrivals[0]].arrival_s <= t:
            i = arrivals.popleft()
            rank = requests[i].rank
            if rank is None:
                rank, turn = turn, (turn + 1) % engine.ranks
            waiting[rank].append(_Live(i, requests[i]))
            arrived = True
        ctrl = control(arrived, bool(produced))
        if model.control is not Control.FITTED:
            rest_links(rest, ctrl)
        t += ctrl
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
        calls = step_all_to_all_s(table, profile, [n for n in padded for _ in range(profile.tp)], compute, rest,
                                  requests=max(reqs), decode=decode_only)
        t += compute  # a TP group's ranks all hold (and dispatch) their engine's tokens
        t += calls
        if stats is not None:
            for key, value in (("steps", 1), ("busy_s", compute + calls), ("loop_s", ctrl)):
                stats[key] = stats.get(key, 0) + value
        seen = t + control(False, bool(produced))  # published by the next iteration's exchange
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


def loop_control_s(model: Model, profile: StepProfile, link: Link, table: LinkTable, arrived: bool,
                   produced: bool) -> float:
    """Seconds of one serving-loop iteration outside the forwards (``megatron.inference.loop``).
    ``FITTED`` (replay/7): the profiled overhead plus four latencies of the fitted constants, every
    iteration. ``LINK_TABLE`` (replay/8): the profiled overhead plus the loop's collectives as it
    makes them, each timed as the run's link table's smallest message after a long rest: the
    header's all-gather every iteration, the commands' broadcast when requests ``arrived``, the
    token updates' gather when the last step ``produced`` tokens. (The profiled overhead, taken on
    loopback, already holds these collectives' loopback latencies, a few tens of microseconds.)"""
    if model.control is Control.FITTED or link.ranks < 2:
        return profile.iteration_s + link.control_s()
    small = table.seconds(table.smallest_bytes, table.smallest_bytes, math.inf)
    return profile.iteration_s + small * (1 + int(arrived) + int(produced))


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


def step_all_to_all_s(table: LinkTable, profile: StepProfile, padded: Sequence[int], compute_s: float,
                      rest: list, requests: int = 0, decode: bool = False) -> float:
    """A step's collectives from the link table (``step_calls``: per MoE layer megatron-core's
    alltoall dispatcher makes the dispatch, where rank r sends its own tokens' remote copies,
    ``d x padded[r]``, and receives the others', the probabilities' exchange, timed as the table's
    smallest message after a long rest (the link's latency), and the combine, the reverse; ``d`` is
    one layer's off-rank bytes per token one way: the profile's ``a2a_bytes_per_token``, measured
    with every rank equally busy, counts both ways over all layers). The step's compute lies
    around the calls as the profile's layout for the kind of step says
    (``StepProfile.layout``). A call lasts as long as its busiest rank link,
    timed with what that link carries each way after the rest its busier direction had: each rank
    link's two directions rest on their own (``rest[r] = [out, in]`` seconds, updated in place), so
    when one rank holds the tokens its dispatches leave on a link that rested through the combine
    before. A rest is the shaper's bucket in seconds of link rate: it fills up to
    ``table.bucket_s``, and a call spends what its bytes take at the link rate (a few KiB of a
    lopsided call's light direction spend little).

    A tensor-parallel engine (``profile.tp`` > 1, TP = EP = the ranks: ``padded`` then has the
    engine's tokens on each of its ranks) adds its TP collectives on the same links:
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
    gaps = profile.layout(decode)
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
