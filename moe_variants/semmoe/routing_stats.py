"""How much token and domain structure a model's routing has: the premise Sem-MoE rests on.

* :func:`activation_concentration` - the paper's Table 1 per MoE layer. For a token seen at
  least ``min_count`` times, its ``K`` hottest experts (by how often it activated each) predict
  the experts of every occurrence: F1 = |predicted ∩ routed| / K (both sets have ``K`` members);
  cumulative hotness = the top-K experts' share of the token's activations; max hotness = the
  largest share among the other experts. p25/p50/p75: F1 over the occurrences (its values are
  multiples of 1 / K, as the paper's), the hotness figures over the distinct tokens (a token's
  mean F1 over its occurrences would equal its cumulative hotness). A router with context-independent affinities gives F1 and cumulative
  hotness near 1; a uniform one gives about K / N.
* :func:`domain_expert_information` - mutual information I(domain; expert) of one layer's
  activations, in bits, from per-domain expert counts: how much knowing the task tells about which
  experts fire (0 when every domain uses the experts alike). Normalised by H(domain) it is the
  share of the domain's uncertainty the expert choice removes.

Shape legend: ``L`` layers, ``S`` occurrences, ``K`` top-k, ``N`` experts, ``V`` vocabulary,
``G`` domains.
"""

from __future__ import annotations

import numpy as np

from .profile import Profile

__all__ = ["activation_concentration", "domain_expert_information", "expert_counts"]


def _quantiles(values: np.ndarray) -> dict:
    p25, p50, p75 = np.percentile(values, [25, 50, 75]) if len(values) else (np.nan,) * 3
    return {"p25": float(p25), "p50": float(p50), "p75": float(p75)}


def activation_concentration(profile: Profile, layer: int, min_count: int = 5) -> dict:
    """Table 1's three metrics for MoE layer ``layer`` (see the module docstring), over the
    tokens seen at least ``min_count`` times; also how many tokens that is."""
    k, n = profile.top_k, profile.num_experts
    counts = profile.counts[layer].tocsr()  # [V, N] activations of each token id
    occurrences = np.bincount(profile.token_ids, minlength=counts.shape[0])
    tokens = np.flatnonzero(occurrences >= min_count)
    dense = counts[tokens].toarray().astype(np.float64)  # [T, N]
    order = np.argsort(-dense, axis=1, kind="stable")
    hot = order[:, :k]  # [T, K] each token's K hottest experts
    total = dense.sum(1)
    top_share = np.take_along_axis(dense, hot, 1).sum(1) / total
    rest = dense.copy()
    np.put_along_axis(rest, hot, -1.0, 1)
    max_rest = rest.max(1).clip(min=0.0) / total if n > k else np.zeros(len(tokens))
    # F1 per occurrence, averaged per token: |hot(token) ∩ routed| / K
    index = np.full(counts.shape[0], -1)
    index[tokens] = np.arange(len(tokens))
    row = index[profile.token_ids]
    seen = row >= 0
    hot_mask = np.zeros((len(tokens), n), dtype=bool)
    np.put_along_axis(hot_mask, hot, True, 1)
    routes = profile.routes[layer][seen].astype(np.int64)  # [S', K]
    f1 = hot_mask[row[seen][:, None], routes].sum(1) / k  # [S'] per occurrence
    return {"layer": int(layer), "tokens": int(len(tokens)), "min_count": int(min_count),
            "f1": _quantiles(f1), "cum_hotness_topk": _quantiles(top_share), "max_hotness_rest": _quantiles(max_rest)}


def expert_counts(profile: Profile, requests: np.ndarray) -> np.ndarray:
    """[L, N] activations of each expert by the tokens of the given requests (indices)."""
    routes = profile.select_requests(np.asarray(requests, dtype=np.int64)).routes  # [L, S', K]
    out = np.zeros((profile.num_layers, profile.num_experts), dtype=np.int64)
    for layer in range(profile.num_layers):
        out[layer] = np.bincount(routes[layer].reshape(-1).astype(np.int64), minlength=profile.num_experts)
    return out


def domain_expert_information(counts: np.ndarray) -> dict:
    """I(domain; expert) in bits from ``counts`` [G, N] (activations of expert n by domain g's
    tokens), with H(domain) and their ratio; domains are weighted by their activations."""
    p = counts.astype(np.float64) / counts.sum()
    pg, pn = p.sum(1, keepdims=True), p.sum(0, keepdims=True)
    nz = p > 0
    mi = float((p[nz] * np.log2(p[nz] / (pg @ pn)[nz])).sum())
    hg = float(-(pg[pg > 0] * np.log2(pg[pg > 0])).sum())
    return {"mutual_information_bits": mi, "domain_entropy_bits": hg, "normalised": mi / hg if hg > 0 else 0.0}
