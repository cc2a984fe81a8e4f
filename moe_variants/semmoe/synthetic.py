"""Synthetic router traces with planted token-expert affinity, for tests and the scale check.

Generative model (all draws from one seeded generator):

1. Every token id belongs to one of ``num_topics`` topics, except a ``common_fraction`` of ids
   that are topic-free (function words). Within a pool, token popularity is Zipf(``zipf``).
2. In each layer the experts are split into ``num_topics`` groups by a per-layer random
   permutation. A topic token prefers ``K`` distinct experts of its topic's group; a common
   token prefers ``K`` distinct experts of a random group (a different one in each layer).
3. A request has a topic; each of its tokens is a topic token with probability
   ``topic_token_prob``, else a common token.
4. Each occurrence routes to its token's preferred experts with probability ``affinity``, else
   to the preferred experts of a uniformly random token id (context noise). ``affinity=0`` gives
   routing that carries no information about the token, so no placement can beat LAR ~ 1/EP.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .profile import Profile, profile_from_arrays

__all__ = ["SyntheticConfig", "PlantedStructure", "synthetic_profile"]


@dataclass(frozen=True)
class SyntheticConfig:
    num_requests: int = 200
    min_len: int = 16
    max_len: int = 64
    vocab_size: int = 2000
    num_layers: int = 4
    num_experts: int = 16
    top_k: int = 2
    num_topics: int = 4
    common_fraction: float = 0.2
    topic_token_prob: float = 0.7
    affinity: float = 0.85
    zipf: float = 1.1
    hidden_size: int = 1024

    def validate(self) -> None:
        if self.num_experts % self.num_topics:
            raise ValueError(f"num_experts ({self.num_experts}) must be a multiple of num_topics ({self.num_topics})")
        if self.num_experts // self.num_topics < self.top_k:
            raise ValueError("each topic's expert group must hold at least top_k experts")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError("need 1 <= min_len <= max_len")
        for name in ("common_fraction", "topic_token_prob", "affinity"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")


@dataclass(frozen=True)
class PlantedStructure:
    """Ground truth of a synthetic profile: request_topic [R], expert_topic [L, N] (the topic whose
    group holds the expert in each layer), token_topic [V] (-1 for common tokens)."""

    request_topic: np.ndarray
    expert_topic: np.ndarray
    token_topic: np.ndarray


def _zipf_sampler(rng: np.random.Generator, pool: np.ndarray, exponent: float):
    weights = 1.0 / np.arange(1, len(pool) + 1) ** exponent
    cdf = np.cumsum(weights) / weights.sum()
    pool = rng.permutation(pool)  # popularity rank unrelated to the id

    def draw(n: int) -> np.ndarray:
        return pool[np.minimum(np.searchsorted(cdf, rng.random(n)), len(pool) - 1)]

    return draw


def synthetic_profile(
    config: SyntheticConfig = SyntheticConfig(), seed: int = 0, return_truth: bool = False
) -> Profile | tuple[Profile, PlantedStructure]:
    """Draw a :class:`Profile` from the generative model in the module docstring (and, with
    ``return_truth``, the planted structure)."""
    config.validate()
    c = config
    rng = np.random.default_rng(seed)
    v, n, g, k, layers = c.vocab_size, c.num_experts, c.num_topics, c.top_k, c.num_layers
    group_size = n // g

    # Step 1: token pools.
    ids = rng.permutation(v)
    num_common = max(1, int(round(c.common_fraction * v)))
    common = ids[:num_common]
    topic_of = np.full(v, -1, dtype=np.int64)
    topic_of[ids[num_common:]] = np.arange(v - num_common) % g
    draw_common = _zipf_sampler(rng, common, c.zipf)
    draw_topic = [_zipf_sampler(rng, np.flatnonzero(topic_of == t), c.zipf) for t in range(g)]

    # Step 2: preferred experts per layer, [L, V, K].
    preferred = np.empty((layers, v, k), dtype=np.int16 if n <= 32767 else np.int32)
    expert_topic = np.empty((layers, n), dtype=np.int64)
    for l in range(layers):
        groups = rng.permutation(n).reshape(g, group_size)
        expert_topic[l, groups] = np.arange(g)[:, None]
        group_of_token = np.where(topic_of >= 0, topic_of, rng.integers(0, g, size=v))
        slot = np.argsort(rng.random((v, group_size)), axis=1)[:, :k]  # K distinct slots per token
        preferred[l] = groups[group_of_token[:, None], slot]

    # Step 3: requests.
    lengths = rng.integers(c.min_len, c.max_len + 1, size=c.num_requests)
    total = int(lengths.sum())
    request_topic = rng.integers(0, g, size=c.num_requests)
    req_topic = np.repeat(request_topic, lengths)
    is_topic = rng.random(total) < c.topic_token_prob
    token_ids = draw_common(total)
    for t in range(g):
        sel = np.flatnonzero(is_topic & (req_topic == t))
        token_ids[sel] = draw_topic[t](len(sel))

    # Step 4: routes.
    routes = np.empty((layers, total, k), dtype=preferred.dtype)
    for l in range(layers):
        follow = rng.random(total) < c.affinity
        source = np.where(follow, token_ids, rng.integers(0, v, size=total))
        routes[l] = preferred[l, source]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    meta = {"source": "synthetic", "seed": seed, "hidden_size": c.hidden_size, "config": c.__dict__}
    profile = profile_from_arrays(token_ids, offsets, routes, v, n, meta)
    if return_truth:
        return profile, PlantedStructure(request_topic, expert_topic, topic_of)
    return profile
