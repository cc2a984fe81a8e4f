"""Load generation and statistics for the serving benchmark, as pure functions.

``poisson_arrivals`` gives request send times for a rate (requests/s) from a seed; ``load_prompts``
reads prompts (JSONL with a ``text`` field, or ShareGPT JSON: a list of ``{"conversations":
[{"from": "human", "value": ...}, ...]}``, the first human turn taken) and ``load_prompt_pairs``
the answers with them (JSONL ``answer``, the ShareGPT model turn after the prompt); ``summarize`` turns
per-request timings into TTFT / TPOT / end-to-end p50/p90/p99 (with the number of samples each
rests on: a p99 needs 100 for one sample beyond it, ``samples_needed``), output tokens/s, requests/s
and goodput at an SLO; ``report`` lays variants out in bench_ep's JSON shape
(``variants.<name>.<metric>`` with p50/p90/p99 or a single value, ``ratios.<name>.throughput_speedup``
against the first variant).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from typing import Optional, Sequence

from megatron.common.cli import UserError

__all__ = ["RequestTiming", "poisson_arrivals", "load_prompts", "load_prompt_pairs", "percentile", "distribution",
           "samples_needed", "PERCENTILES", "summarize", "report"]


@dataclasses.dataclass
class RequestTiming:
    """One request as the client saw it (seconds from its send time)."""

    ttft_s: Optional[float]  # first token; None if none came
    e2e_s: float  # last byte
    output_tokens: int
    ok: bool = True

    @property
    def tpot_s(self) -> Optional[float]:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def poisson_arrivals(rate: float, num_requests: int, seed: int) -> list:
    """Send times (s from the start) of ``num_requests`` requests arriving as a Poisson process
    of ``rate`` requests/s (exponential gaps); ``inf`` rate: all at 0."""
    if rate <= 0:
        raise UserError(f"--request-rates: rates must be > 0, got {rate:g}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def load_prompts(path: str, limit: Optional[int] = None) -> list:
    """Prompt texts from a JSONL file (``text`` field per line) or a ShareGPT JSON file."""
    return [text for text, _ in load_prompt_pairs(path, limit)]


def load_prompt_pairs(path: str, limit: Optional[int] = None) -> list:
    """``(prompt, answer or None)`` pairs from a JSONL file (``text``, optional ``answer`` field per
    line) or a ShareGPT JSON file (the first human turn and the model turn after it, when there is
    one: the benchmark takes its length as the request's output length)."""
    if os.path.isdir(path):
        raise UserError(f"--prompts {path}: is a directory; name one JSONL or ShareGPT JSON file in it")
    try:
        f = open(path, encoding="utf-8")
    except OSError as err:
        raise UserError(f"--prompts {path}: {err.strerror}") from None
    with f:
        head = f.read(1)
        f.seek(0)
        pairs = []
        if head == "[":
            try:
                items = json.load(f)
            except json.JSONDecodeError as err:
                raise UserError(f"--prompts {path}: not valid JSON ({err.msg})") from None
            for item in items:
                turns = (item.get("conversations") if isinstance(item, dict) else None) or []
                idx = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
                if idx is None or not isinstance(turns[idx].get("value"), str) or not turns[idx]["value"].strip():
                    continue
                answer = next((t.get("value") for t in turns[idx + 1:idx + 2] if t.get("from") in ("gpt", "assistant")),
                              None)
                pairs.append((turns[idx]["value"], answer if isinstance(answer, str) else None))
        else:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record.get("text")
                except (json.JSONDecodeError, AttributeError):
                    raise UserError(f"--prompts {path}: line {n} is not a JSON object") from None
                if not isinstance(text, str):
                    raise UserError(f"--prompts {path}: line {n} has no string 'text' field")
                answer = record.get("answer")
                pairs.append((text, answer if isinstance(answer, str) else None))
    if not pairs:
        raise UserError(f"--prompts {path}: no prompts found")
    return pairs[:limit] if limit else pairs


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolation percentile (numpy's default) of ``values``; None when empty."""
    vals = sorted(values)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


PERCENTILES = (50, 90, 99)


def samples_needed(q: float) -> int:
    """Samples a ``q``-th percentile needs so that at least one is expected beyond it,
    ``n (1 - q / 100) >= 1``: ``ceil(100 / (100 - q))`` (p50: 2, p90: 10, p99: 100). With fewer it is
    interpolated between the largest samples and mostly reports the maximum."""
    return math.ceil(100.0 / (100.0 - q) - 1e-9)


def distribution(values) -> dict:
    """``{"p50", "p90", "p99", "n"}`` of ``values`` (each percentile None when there are none; ``n``
    the number of samples, which ``samples_needed`` compares with)."""
    values = list(values)
    return {**{f"p{q}": percentile(values, q) for q in PERCENTILES}, "n": len(values)}


def summarize(timings: Sequence[RequestTiming], duration_s: float, *, slo_ttft_s: Optional[float] = None,
              slo_tpot_s: Optional[float] = None) -> dict:
    """Per-run statistics: latency distributions, throughput and goodput (requests/s meeting both
    SLOs; an SLO not given is met)."""
    if duration_s <= 0:
        raise ValueError("the run's duration must be > 0")
    ok = [t for t in timings if t.ok]
    good = [t for t in ok if (slo_ttft_s is None or (t.ttft_s is not None and t.ttft_s <= slo_ttft_s))
            and (slo_tpot_s is None or t.tpot_s is None or t.tpot_s <= slo_tpot_s)]
    return {
        "ttft_s": distribution([t.ttft_s for t in ok if t.ttft_s is not None]),
        "tpot_s": distribution([t.tpot_s for t in ok if t.tpot_s is not None]),
        "e2e_s": distribution([t.e2e_s for t in ok]),
        "output_tokens_per_s": sum(t.output_tokens for t in ok) / duration_s,
        "requests_per_s": len(ok) / duration_s,
        "goodput_requests_per_s": len(good) / duration_s,
        "failed_requests": len(timings) - len(ok),
    }


def report(per_variant: dict, *, meta: Optional[dict] = None, throughput_key: str = "output_tokens_per_s") -> dict:
    """bench_ep's shape: ``{"variants": {name: stats}, "ratios": {name: {"throughput_speedup"}}}``
    (the first variant is the baseline; ``throughput_key`` names the throughput, output tokens/s by
    default). Variants with a per-rate breakdown (``stats["rates"][rate]``) also get
    ``ratios[name]["rates"][rate]["throughput_speedup"]`` for the rates the baseline has."""
    names = list(per_variant)
    if not names:
        raise ValueError("no variants to report")

    def ratio(num, den):
        return num / den if num is not None and den else None

    base = per_variant[names[0]]
    ratios = {}
    for n in names:
        ratios[n] = {"throughput_speedup": ratio(per_variant[n][throughput_key], base[throughput_key])}
        rates, base_rates = per_variant[n].get("rates"), base.get("rates") or {}
        if rates:
            ratios[n]["rates"] = {r: {"throughput_speedup": ratio(s[throughput_key], base_rates[r][throughput_key])}
                                  for r, s in rates.items() if r in base_rates}
    return {"meta": dict(meta or {}), "variants": per_variant, "ratios": ratios}
