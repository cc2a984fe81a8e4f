"""The server's ``/metrics`` in Prometheus' text exposition format (version 0.0.4), no dependency.

Request and token counters and the TTFT / TPOT / end-to-end latency histograms are kept by the
frontend (rank 0); the engine gauges (running and waiting requests, KV-cache blocks) and the
all-to-all counters come from every rank's ``RankEngine.stats()`` and carry a ``rank`` label.
``moe_serve_all_to_all_bytes_per_token`` is the bytes all ranks sent to other ranks in expert
all-to-alls (dispatch, combine and routing metadata; dummy forwards of idle ranks and the
engine's token padding included) divided by the real tokens all ranks fed through the model
(prompt and generated tokens). ``moe_serve_local_activation_rate`` is Sem-MoE's LAR over all
ranks: the (real token, routed expert) pairs whose expert is on the rank that holds the token,
over all such pairs; ``moe_serve_expert_activations_total{layer, device}`` counts the pairs whose
expert is on each device, per MoE layer, over all ranks' tokens (the expert load behind the load
imbalance max / mean over devices).
"""

from __future__ import annotations

import bisect
import math
from typing import Optional, Sequence

__all__ = ["Histogram", "ServingMetrics", "LATENCY_BUCKETS_S"]

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _fmt(value: float) -> str:
    value = float(value)
    if value == math.inf:
        return "+Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


class Histogram:
    """Cumulative buckets (upper bounds in ``buckets``), sum and count."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS_S):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list:
        out, running = [], 0
        for bound, count in zip(self.buckets + (math.inf,), self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{_fmt(bound)}"}} {running}')
        out.append(f"{name}_sum {_fmt(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


class ServingMetrics:
    """Everything ``/metrics`` shows (single-threaded use: the frontend's event loop)."""

    def __init__(self, model: str):
        self.model = model
        # lost: in flight when the engine failed or was lost (answered 503)
        self.requests = {"completed": 0, "aborted": 0, "failed": 0, "timeout": 0, "rejected": 0, "lost": 0}
        self.engine_restarts = 0  # engines that connected again after a loss (front end in its own process)
        self.resubmitted = 0  # engine requests in flight at a loss, held and sent to the restarted engine
        self.held = 0  # engine requests held now, waiting for the engine to come back
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.running = 0
        self.queued = 0
        self.ttft = Histogram()
        self.tpot = Histogram()
        self.e2e = Histogram()
        self.rank_stats: list = []

    def finished(self, status: str, *, prompt_tokens: int, generation_tokens: int,
                 ttft_s: Optional[float], tpot_s: Optional[float], e2e_s: float) -> None:
        self.requests[status] += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        self.e2e.observe(e2e_s)

    def a2a_bytes_per_token(self) -> Optional[float]:
        tokens = sum(s["tokens_forwarded"] for s in self.rank_stats)
        if not tokens:
            return None
        return sum(s["a2a_bytes"] for s in self.rank_stats) / tokens

    def local_activation_rate(self) -> Optional[float]:
        routed = sum(s["routed_activations"] for s in self.rank_stats)
        return sum(s["local_activations"] for s in self.rank_stats) / routed if routed else None

    def render(self) -> str:
        lines = []

        def metric(name, kind, help_text, samples):
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)

        metric("moe_serve_requests_total", "counter",
               "Engine requests by outcome (one per prompt; rejected: HTTP requests refused; lost: in "
               "flight when the engine failed).",
               [f'moe_serve_requests_total{{status="{k}"}} {v}' for k, v in self.requests.items()])
        metric("moe_serve_engine_restarts_total", "counter",
               "Times a restarted engine served again after a failure (torchrun --max-restarts).",
               [f"moe_serve_engine_restarts_total {self.engine_restarts}"])
        metric("moe_serve_requests_resubmitted_total", "counter",
               "Engine requests in flight when the engine was lost, held and sent again to the restarted engine.",
               [f"moe_serve_requests_resubmitted_total {self.resubmitted}"])
        metric("moe_serve_requests_held", "gauge",
               "Engine requests held while the engine restarts (in flight at the loss, or arrived since).",
               [f"moe_serve_requests_held {self.held}"])
        metric("moe_serve_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
               [f"moe_serve_prompt_tokens_total {self.prompt_tokens}"])
        metric("moe_serve_generation_tokens_total", "counter", "Tokens returned to clients.",
               [f"moe_serve_generation_tokens_total {self.generation_tokens}"])
        metric("moe_serve_requests_in_flight", "gauge", "HTTP requests the frontend is serving.",
               [f"moe_serve_requests_in_flight {self.running}"])
        metric("moe_serve_requests_queued", "gauge", "Engine requests without a first token yet.",
               [f"moe_serve_requests_queued {self.queued}"])
        metric("moe_serve_time_to_first_token_seconds", "histogram", "Arrival to first token.",
               self.ttft.lines("moe_serve_time_to_first_token_seconds"))
        metric("moe_serve_time_per_output_token_seconds", "histogram",
               "Mean time between output tokens of a request.",
               self.tpot.lines("moe_serve_time_per_output_token_seconds"))
        metric("moe_serve_e2e_request_latency_seconds", "histogram", "Arrival to last token.",
               self.e2e.lines("moe_serve_e2e_request_latency_seconds"))
        per_rank = [
            ("moe_serve_engine_requests_running", "gauge", "Requests in the rank's engine batch.", "requests_active"),
            ("moe_serve_engine_requests_waiting", "gauge", "Requests queued in the rank's engine.", "requests_waiting"),
            ("moe_serve_kv_cache_blocks_used", "gauge", "KV-cache blocks held by requests.", "kv_blocks_used"),
            ("moe_serve_kv_cache_blocks_total", "gauge", "KV-cache blocks of the rank.", "kv_blocks_total"),
            ("moe_serve_tokens_forwarded_total", "counter", "Real tokens through the rank's model.", "tokens_forwarded"),
            ("moe_serve_requests_assigned_total", "counter", "Requests the scheduler gave the rank.", "requests_added"),
            ("moe_serve_engine_steps_total", "counter", "Engine steps with work.", "steps"),
            ("moe_serve_dummy_forwards_total", "counter", "Forwards of an idle expert-parallel rank.", "dummy_steps"),
            ("moe_serve_engine_busy_seconds_total", "counter",
             "Wall time in engine steps and dummy forwards.", "busy_s"),
            ("moe_serve_all_to_all_bytes_total", "counter", "Expert all-to-all bytes sent to other ranks.", "a2a_bytes"),
            ("moe_serve_all_to_all_seconds_total", "counter", "Wall time with an expert all-to-all in flight.", "a2a_time_s"),
            ("moe_serve_all_to_all_exposed_seconds_total", "counter",
             "Time the compute thread waited on expert all-to-alls.", "a2a_exposed_s"),
            ("moe_serve_routed_activations_total", "counter",
             "(Real token, routed expert) pairs of the rank's tokens.", "routed_activations"),
            ("moe_serve_local_activations_total", "counter",
             "Routed pairs whose expert is on the rank.", "local_activations"),
        ]
        for name, kind, help_text, key in per_rank:
            metric(name, kind, help_text,
                   [f'{name}{{rank="{r}"}} {_fmt(s[key])}' for r, s in enumerate(self.rank_stats)])
        used = sum(s["kv_blocks_used"] for s in self.rank_stats)
        total = sum(s["kv_blocks_total"] for s in self.rank_stats)
        metric("moe_serve_kv_cache_usage_ratio", "gauge", "KV-cache blocks in use over all ranks.",
               [f"moe_serve_kv_cache_usage_ratio {_fmt(used / total if total else 0.0)}"])
        per_token = self.a2a_bytes_per_token()
        metric("moe_serve_all_to_all_bytes_per_token", "gauge",
               "All-to-all bytes over all ranks per real token forwarded (NaN before the first).",
               [f"moe_serve_all_to_all_bytes_per_token {_fmt(per_token) if per_token is not None else 'NaN'}"])
        load = {}
        for s in self.rank_stats:
            for l, per_device in enumerate(s.get("activations_to_device") or []):
                for d, n in enumerate(per_device):
                    load[(l, d)] = load.get((l, d), 0) + int(n)
        metric("moe_serve_expert_activations_total", "counter",
               "Routed pairs of real tokens whose expert is on the device, per MoE layer, all ranks.",
               [f'moe_serve_expert_activations_total{{layer="{l}",device="{d}"}} {n}' for (l, d), n in sorted(load.items())])
        lar = self.local_activation_rate()
        metric("moe_serve_local_activation_rate", "gauge",
               "Local activations over routed activations, all ranks (NaN before the first).",
               [f"moe_serve_local_activation_rate {_fmt(lar) if lar is not None else 'NaN'}"])
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict:
    """``{sample name with labels: value}`` of a text exposition (for tests and the benchmark)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out
