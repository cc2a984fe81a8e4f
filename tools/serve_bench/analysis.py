"""Statistics of the serving benchmark, as pure functions of the load client's phase results.

A phase result (``tools.serve_bench.client``) holds every request (send time, TTFT, end-to-end
time, tokens) and the server's ``/metrics`` before and after the phase. From the per-rank engine
counters of ``/metrics`` (``megatron.inference.metrics``) a phase's deltas give:

* ``tokens_forwarded``      real tokens through the model, all ranks (prompt and generated);
* ``engine_busy_s``         mean over ranks of the wall time inside engine steps and the dummy
                            forwards of idle expert-parallel ranks;
* ``a2a_bytes_per_token``   all-to-all bytes all ranks sent to other ranks, per forwarded token
                            (dispatch, combine and routing metadata; the engine's padding tokens
                            and dummy forwards are dispatched too, so this is the engine's cost);
* ``a2a_time_s``, ``a2a_fraction``  mean over ranks of the wall time with an expert all-to-all in
                            flight, and its share of ``engine_busy_s``;
* ``exposed_a2a_s``, ``exposed_fraction``  the time the compute thread waited on them, and its
                            share; ``overlap`` = 1 - exposed / in flight;
* ``exposed_a2a_s_per_output_token`` (serving) / ``..._per_prompt_token`` (prefill);
* ``lar``                   Sem-MoE's local activation rate: (real token, routed expert) pairs whose
                            expert is on the token's rank, over all pairs (padding and dummy
                            forwards excluded);
* ``load_imbalance``        per MoE layer, max / mean over devices of the pairs routed to each
                            device's experts; ``mean`` and ``max`` over layers.

``serve_stats`` adds the request statistics of ``loadgen.summarize`` (TTFT, TPOT, end-to-end
p50/p90/p99, output tokens/s, requests/s, goodput); ``prefill_stats`` prefill tokens/s (prompt
tokens over the burst's wall time, first send to last answer) and the engine's forward tokens/s
(forwarded tokens over ``engine_busy_s``), median/min/max over repeated bursts.
``probe_fraction`` is the rate search's measurement, as bench_ep's: median all-to-all time over
(median all-to-all + fastest compute), per (rank, round).

Transfer and rank-skew wait: with the servers' step spans (``serve --a2a-spans``) ``phase_split``
matches each engine step's all-to-alls across ranks (``tools.bench.overlap.transfer_skew``) for the
steps inside a phase's window; a phase carrying that split (``phase["a2a_split"]``) adds
``transfer_s``/``skew_s`` (mean over ranks) and ``transfer_fraction``/``skew_fraction`` of
``engine_busy_s`` (``a2a_fraction`` = their sum). Amdahl's bounds use the transfer share when it is
there (``amdahl_basis``): the skew wait is the ranks' imbalance, which no cheaper all-to-all removes.

Several runs (``--runs``): ``serve_over_runs``/``prefill_over_runs`` take each run's figures and give
their median with an interval (the range of the runs, or at 5 runs or more a 95% bootstrap
interval: ``tools.bench.discipline.median_ci``); the speedups are
paired by run.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from tools.bench.aggregate import summarize as summarize_values
from tools.bench.aggregate import uncontended_comm_fraction
from tools.bench.discipline import median_ci, paired_ratios
from tools.bench.overlap import transfer_skew

from .loadgen import PERCENTILES, RequestTiming, distribution, summarize

__all__ = ["RANK_COUNTERS", "rank_deltas", "device_load", "sum_load", "load_imbalance", "comm_summary", "serve_stats", "pooled_serve_stats", "prefill_stats",
           "probe_fraction", "prefill_ratios", "amdahl_bound", "serve_bounds", "phase_split", "split_summary", "SERVE_FIGURES",
           "serve_over_runs", "prefill_over_runs", "run_figure"]

RANK_COUNTERS = {
    "tokens": "moe_serve_tokens_forwarded_total",
    "busy_s": "moe_serve_engine_busy_seconds_total",
    "a2a_bytes": "moe_serve_all_to_all_bytes_total",
    "a2a_s": "moe_serve_all_to_all_seconds_total",
    "exposed_s": "moe_serve_all_to_all_exposed_seconds_total",
    "steps": "moe_serve_engine_steps_total",
    "dummy_forwards": "moe_serve_dummy_forwards_total",
    "local": "moe_serve_local_activations_total",
    "routed": "moe_serve_routed_activations_total",
}
_OPTIONAL = ("local", "routed")
DEVICE_LOAD = "moe_serve_expert_activations_total"
_RANK_RE = re.compile(r'\{rank="(\d+)"\}$')
_LOAD_RE = re.compile(r'\{layer="(\d+)",device="(\d+)"\}$')


def _ranks(metrics: dict) -> list:
    name = RANK_COUNTERS["busy_s"]
    return sorted(int(m.group(1)) for k in metrics if k.startswith(name) and (m := _RANK_RE.search(k)))


def rank_deltas(before: dict, after: dict) -> list:
    """Per rank ``{counter: after - before}`` for ``RANK_COUNTERS``."""
    ranks = _ranks(after)
    if not ranks:
        raise ValueError("/metrics has no per-rank engine counters")
    out = []
    for r in ranks:
        d = {}
        for key, name in RANK_COUNTERS.items():
            sample = f'{name}{{rank="{r}"}}'
            if key in _OPTIONAL and sample not in after:  # a model whose routers report no top-k
                d[key] = 0.0
                continue
            d[key] = after[sample] - before.get(sample, 0.0)
        out.append(d)
    return out


def device_load(before: dict, after: dict) -> list:
    """[L][D] pairs routed to each device's experts during the phase (``DEVICE_LOAD`` deltas)."""
    cells = {}
    for key, value in after.items():
        if key.startswith(DEVICE_LOAD) and (m := _LOAD_RE.search(key)):
            cells[(int(m.group(1)), int(m.group(2)))] = value - before.get(key, 0.0)
    if not cells:
        return []
    layers, devices = max(l for l, _ in cells) + 1, max(d for _, d in cells) + 1
    return [[cells.get((l, d), 0.0) for d in range(devices)] for l in range(layers)]


def load_imbalance(load: Sequence[Sequence[float]]) -> Optional[dict]:
    """Max / mean device load per layer; its mean and max over layers (None without load)."""
    per_layer = [max(row) / (sum(row) / len(row)) for row in load if sum(row) > 0]
    if not per_layer:
        return None
    return {"mean": sum(per_layer) / len(per_layer), "max": max(per_layer), "per_layer": per_layer}


def _div(num, den) -> Optional[float]:
    return num / den if den else None


def comm_summary(deltas: Sequence[dict], *, output_tokens: Optional[int] = None,
                 prompt_tokens: Optional[int] = None) -> dict:
    """The all-to-all and engine figures of the module docstring from per-rank deltas."""
    n = len(deltas)
    tokens = sum(d["tokens"] for d in deltas)
    busy = sum(d["busy_s"] for d in deltas) / n
    a2a = sum(d["a2a_s"] for d in deltas) / n
    exposed = sum(d["exposed_s"] for d in deltas) / n
    out = {
        "tokens_forwarded": int(tokens),
        "engine_busy_s": busy,
        "engine_steps": int(sum(d["steps"] for d in deltas)),
        "dummy_forwards": int(sum(d["dummy_forwards"] for d in deltas)),
        "a2a_bytes_per_token": _div(sum(d["a2a_bytes"] for d in deltas), tokens),
        "a2a_time_s": a2a,
        "a2a_fraction": _div(a2a, busy),
        "exposed_a2a_s": exposed,
        "exposed_fraction": _div(exposed, busy),
        "overlap": (1.0 - exposed / a2a) if a2a > 0 else None,
        "lar": _div(sum(d["local"] for d in deltas), sum(d["routed"] for d in deltas)),
        "local_activations": int(sum(d["local"] for d in deltas)),
        "routed_activations": int(sum(d["routed"] for d in deltas)),
    }
    if output_tokens is not None:
        out["exposed_a2a_s_per_output_token"] = _div(exposed, output_tokens)
    if prompt_tokens is not None:
        out["exposed_a2a_s_per_prompt_token"] = _div(exposed, prompt_tokens)
    return out


def phase_split(spans_by_rank: Sequence[Sequence[dict]], clock_start: float, clock_end: float) -> Optional[dict]:
    """Per rank transfer time and rank-skew wait of the engine steps that began inside
    ``[clock_start, clock_end]`` (rank 0's step start). ``spans_by_rank[r]`` is rank r's step lines
    (``{"t", "spans"}``, ``serve --a2a-spans``), matched by position: every expert-parallel rank
    forwards in lock-step. ``{"transfer_s": [per rank], "skew_s": [per rank], "steps"}``; None when
    the ranks recorded different numbers of steps or collectives."""
    if not spans_by_rank or any(len(lines) != len(spans_by_rank[0]) for lines in spans_by_rank):
        return None
    transfer, skew, steps = [0.0] * len(spans_by_rank), [0.0] * len(spans_by_rank), 0
    for k, line in enumerate(spans_by_rank[0]):
        if not clock_start <= line["t"] <= clock_end:
            continue
        split = transfer_skew([lines[k]["spans"] for lines in spans_by_rank])
        if split is None:
            return None
        steps += 1
        for r, x in enumerate(split):
            transfer[r] += x["transfer_s"]
            skew[r] += x["skew_s"]
    return {"transfer_s": transfer, "skew_s": skew, "steps": steps}


def split_summary(splits: Sequence[Optional[dict]], busy_s: float) -> dict:
    """``transfer_s``/``skew_s`` (summed over phases, mean over ranks) and their shares of
    ``busy_s``; None values unless every phase has a split."""
    if not splits or any(x is None for x in splits):
        return {"transfer_s": None, "skew_s": None, "transfer_fraction": None, "skew_fraction": None}
    ranks = len(splits[0]["transfer_s"])
    transfer = sum(sum(x["transfer_s"]) for x in splits) / ranks
    skew = sum(sum(x["skew_s"]) for x in splits) / ranks
    return {"transfer_s": transfer, "skew_s": skew, "transfer_fraction": _div(transfer, busy_s),
            "skew_fraction": _div(skew, busy_s)}


def _timings(requests) -> list:
    return [RequestTiming(r["ttft_s"], r["e2e_s"], int(r["output_tokens"]), bool(r["ok"])) for r in requests]


def _sum_deltas(all_deltas: Sequence[Sequence[dict]]) -> list:
    out = [dict(d) for d in all_deltas[0]]
    for deltas in all_deltas[1:]:
        if len(deltas) != len(out):
            raise ValueError("phases report different numbers of ranks")
        for acc, d in zip(out, deltas):
            for k, v in d.items():
                acc[k] += v
    return out


def serve_stats(phases: Sequence[dict], *, slo_ttft_s=None, slo_tpot_s=None) -> dict:
    """Request and engine statistics of one or more serving phases pooled: latencies over all their
    requests, throughputs over the sum of their durations, engine counters summed."""
    requests = [r for p in phases for r in p["requests"]]
    duration = sum(p["duration_s"] for p in phases)
    out = summarize(_timings(requests), duration, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
    ok = [r for r in requests if r["ok"]]
    output_tokens = sum(int(r["output_tokens"]) for r in ok)
    out.update(num_requests=len(requests), duration_s=duration, output_tokens=output_tokens,
               prompt_tokens=sum(int(r["prompt_tokens"]) for r in ok),
               short_outputs=sum(1 for r in ok if int(r["output_tokens"]) != int(r["max_tokens"])))
    deltas = _sum_deltas([rank_deltas(p["metrics_before"], p["metrics_after"]) for p in phases])
    out.update(comm_summary(deltas, output_tokens=output_tokens))
    out.update(split_summary([p.get("a2a_split") for p in phases], out["engine_busy_s"]))
    out["load_imbalance"] = load_imbalance(sum_load([device_load(p["metrics_before"], p["metrics_after"])
                                                      for p in phases]))
    return out


def sum_load(loads: Sequence[list]) -> list:
    loads = [x for x in loads if x]
    if not loads:
        return []
    return [[sum(x[l][d] for x in loads) for d in range(len(loads[0][l]))] for l in range(len(loads[0]))]


def pooled_serve_stats(per_rate: dict, phases: dict, **slo) -> dict:
    """A variant's top level: every rate's phase pooled (``serve_stats``), with ``rates``."""
    out = serve_stats(list(phases.values()), **slo)
    out["rates"] = per_rate
    return out


def _prefill_one(phase: dict) -> dict:
    ok = [r for r in phase["requests"] if r["ok"]]
    prompt_tokens = sum(int(r["prompt_tokens"]) for r in ok)
    comm = comm_summary(rank_deltas(phase["metrics_before"], phase["metrics_after"]), prompt_tokens=prompt_tokens)
    comm.update(split_summary([phase.get("a2a_split")], comm["engine_busy_s"]))
    return {
        "duration_s": phase["duration_s"],
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_per_s": prompt_tokens / phase["duration_s"] if phase["duration_s"] > 0 else None,
        "forward_tokens_per_s": _div(comm["tokens_forwarded"], comm["engine_busy_s"]),
        **comm,
    }


PREFILL_SUMMARIZED = ("prefill_tokens_per_s", "forward_tokens_per_s", "a2a_fraction", "exposed_fraction",
                      "transfer_fraction", "skew_fraction")


def prefill_stats(phases: Sequence[dict]) -> dict:
    """Forward-only throughput of prefill bursts (requests of ``max_tokens`` 1), one phase per
    repeat: ``PREFILL_SUMMARIZED`` as ``{"median", "min", "max", "n"}`` over the repeats (bench_ep's
    shape), the rest pooled over them; ``repeats`` keeps each repeat's figures."""
    repeats = [_prefill_one(p) for p in phases]
    requests = [r for p in phases for r in p["requests"]]
    ok = [r for r in requests if r["ok"]]
    pooled = comm_summary(_sum_deltas([rank_deltas(p["metrics_before"], p["metrics_after"]) for p in phases]),
                          prompt_tokens=sum(int(r["prompt_tokens"]) for r in ok))
    pooled.update(split_summary([p.get("a2a_split") for p in phases], pooled["engine_busy_s"]))
    out = {
        "num_requests": len(requests),
        "failed_requests": len(requests) - len(ok),
        "duration_s": sum(p["duration_s"] for p in phases),
        "prompt_tokens": sum(int(r["prompt_tokens"]) for r in ok),
        "ttft_s": distribution([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
    }
    out.update(pooled)
    for key in PREFILL_SUMMARIZED:
        values = [r.get(key) for r in repeats if r.get(key) is not None]
        out[key] = summarize_values(values) if values else None
    out["repeats"] = repeats
    return out


def probe_fraction(phases: Sequence[dict]) -> float:
    """All-to-all share of the engine's forwards over probe rounds, at the fastest compute seen:
    ``A / (A + C_min)`` with ``A`` the median in-flight time and ``C`` busy minus exposed time,
    over (rank, round) pairs (``tools.bench.aggregate.uncontended_comm_fraction``)."""
    a2a, compute = [], []
    for p in phases:
        for d in rank_deltas(p["metrics_before"], p["metrics_after"]):
            a2a.append(d["a2a_s"])
            compute.append(d["busy_s"] - d["exposed_s"])
    return uncontended_comm_fraction({"a2a_time_s": summarize_values(a2a), "compute_s": summarize_values(compute)})


def amdahl_bound(fraction: Optional[float], remaining: float = 0.0) -> Optional[float]:
    """Speedup when a ``fraction`` of the time shrinks to ``remaining`` x itself (0: removed)."""
    if fraction is None:
        return None
    den = (1.0 - fraction) + fraction * remaining
    return 1.0 / den if den > 0 else None  # unbounded


def _median(stat) -> Optional[float]:
    return stat["median"] if stat else None


def prefill_ratios(per_variant: dict) -> dict:
    """Against the first variant (medians over repeats): throughput and forward speedups, the
    all-to-all bytes ratio, and Amdahl's bounds for the baseline's measured all-to-all share: all
    of it removed (``amdahl_bound``) and scaled by the bytes ratio (``amdahl_bound_bytes``). The
    share is the transfer share where the split was recorded (``amdahl_basis`` "transfer"), else
    the in-flight share ("in flight")."""
    names = list(per_variant)
    base = per_variant[names[0]]
    in_flight = _median(base["a2a_fraction"])
    transfer = _median(base.get("transfer_fraction"))
    share = transfer if transfer is not None else in_flight
    out = {}
    for n in names:
        s = per_variant[n]
        bytes_ratio = _div(s["a2a_bytes_per_token"], base["a2a_bytes_per_token"])
        out[n] = {
            "throughput_speedup": _div(_median(s["prefill_tokens_per_s"]), _median(base["prefill_tokens_per_s"])),
            "forward_speedup": _div(_median(s["forward_tokens_per_s"]), _median(base["forward_tokens_per_s"])),
            "bytes_ratio": bytes_ratio,
            "baseline_a2a_fraction": in_flight,
            "baseline_transfer_fraction": transfer,
            "amdahl_basis": "transfer" if transfer is not None else "in flight",
            "amdahl_bound": amdahl_bound(share),
            "amdahl_bound_bytes": amdahl_bound(share, bytes_ratio) if bytes_ratio is not None else None,
        }
    return out


def serve_bounds(per_variant: dict, ratios: dict) -> dict:
    """Serve mode, per rate: the all-hidden bound and each variant's share of it.

    The bound is Amdahl's speedup over the baseline (the first variant) with its measured
    all-to-all time removed: its transfer share where the split was recorded, else its in-flight
    share (medians over runs where there are several). ``fraction_of_bound`` is a variant's
    throughput speedup (median over runs, paired by run; else pooled) over that bound: 1.0 means
    the variant serves as fast as the baseline would with free communication. It reads at rates
    where the baseline saturates; below saturation throughput is the offered load. A variant that
    sends fewer bytes but hides none (Sem-MoE's placement, say) is held to the bound of the bytes it
    saves: ``bytes_ratio`` (its all-to-all bytes per token over the baseline's at that rate; pooled
    over runs), ``bytes_bound`` (Amdahl's with the share scaled by it) and ``fraction_of_bytes_bound``.
    ``{variant: {rate: {"all_hidden_bound", "amdahl_basis", "baseline_share", "fraction_of_bound",
    "bytes_ratio", "bytes_bound", "fraction_of_bytes_bound"}}}``."""
    names = list(per_variant)
    base_rates = per_variant[names[0]].get("rates") or {}
    out = {}
    for n in names:
        out[n] = {}
        for rate, r in (per_variant[n].get("rates") or {}).items():
            b = base_rates.get(rate)
            if b is None:
                continue
            over = b.get("over_runs") or {}
            transfer = _median(over.get("transfer_fraction")) if over else b.get("transfer_fraction")
            in_flight = _median(over.get("a2a_fraction")) if over else b.get("a2a_fraction")
            share = transfer if transfer is not None else in_flight
            bound = amdahl_bound(share)
            ratio = (ratios.get(n, {}).get("rates") or {}).get(rate, {})
            speedup = _median((ratio.get("over_runs") or {}).get("throughput_speedup")) \
                if ratio.get("over_runs") else ratio.get("throughput_speedup")
            bytes_ratio = _div(r.get("a2a_bytes_per_token"), b.get("a2a_bytes_per_token"))
            bytes_bound = amdahl_bound(share, bytes_ratio) if bytes_ratio is not None else None
            out[n][rate] = {"all_hidden_bound": bound, "amdahl_basis": "transfer" if transfer is not None else
                            "in flight", "baseline_share": share, "fraction_of_bound": _div(speedup, bound),
                            "bytes_ratio": bytes_ratio, "bytes_bound": bytes_bound,
                            "fraction_of_bytes_bound": _div(speedup, bytes_bound)}
    return out


# a serving run's figures per rate whose medians over runs are reported (``serve_over_runs``);
# "ttft_s.p99" is the p99 of the run's TTFTs
SERVE_FIGURES = ("output_tokens_per_s", "requests_per_s", "goodput_requests_per_s", "a2a_fraction",
                 "transfer_fraction", "skew_fraction") + tuple(
    f"{key}.p{q}" for key in ("ttft_s", "tpot_s", "e2e_s") for q in PERCENTILES)


def run_figure(stats: dict, name: str):
    """A ``SERVE_FIGURES`` entry of a rate's stats (``"ttft_s.p99"``: the p99 of its TTFTs)."""
    if "." in name:
        key, q = name.split(".")
        return (stats.get(key) or {}).get(q)
    return stats.get(name)


def _ci(values: Sequence, seed: int) -> Optional[dict]:
    values = [v for v in values if v is not None]
    return median_ci(values, seed=seed) if values else None


def serve_over_runs(per_run: Sequence[dict], baseline: str, seed: int = 0) -> dict:
    """``{variant: {rate: {figure: median_ci over runs, "throughput_speedup": median_ci}}}`` from
    ``per_run[r] = {variant: serving stats of run r}`` (``pooled_serve_stats``' shape, with
    ``rates``); the speedup is output tokens/s over the baseline's in the same run."""
    out = {}
    for name in per_run[0]:
        out[name] = {}
        for rate in per_run[0][name]["rates"]:
            runs = [run[name]["rates"][rate] for run in per_run]
            figures = {f: _ci([run_figure(x, f) for x in runs], seed) for f in SERVE_FIGURES}
            base = [run[baseline]["rates"].get(rate, {}).get("output_tokens_per_s") for run in per_run]
            figures["throughput_speedup"] = _ci(paired_ratios([x["output_tokens_per_s"] for x in runs], base), seed)
            out[name][rate] = figures
    return out


def prefill_over_runs(per_run: Sequence[dict], baseline: str, seed: int = 0) -> dict:
    """``{variant: {figure: median_ci over runs of the run's median, "throughput_speedup",
    "forward_speedup"}}`` from ``per_run[r] = {variant: prefill_stats of run r}``."""
    out = {}
    for name in per_run[0]:
        figures = {key: _ci([_median(run[name].get(key)) for run in per_run], seed) for key in PREFILL_SUMMARIZED}
        for ratio, key in (("throughput_speedup", "prefill_tokens_per_s"), ("forward_speedup", "forward_tokens_per_s")):
            figures[ratio] = _ci(paired_ratios([_median(run[name][key]) for run in per_run],
                                               [_median(run[baseline][key]) for run in per_run]), seed)
        out[name] = figures
    return out
