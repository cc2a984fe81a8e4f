"""Activation profile: what a model's routers chose for every token of a set of requests.

Sem-MoE (paper §3.2) predicts routing from token identity alone, so the profile keeps, per MoE layer,
the token-id x expert activation counts (scipy CSR, sparse: a token activates few experts) plus the
raw per-occurrence top-k routes, from which the solver derives request affinities and, once a
placement exists, per-token device sequences for the 2-gram table A (paper App. B.1).

Shape legend: ``V`` vocabulary, ``N`` experts per layer, ``L`` MoE layers, ``K`` top-k, ``R``
requests, ``S`` token occurrences over all requests, ``H`` embedding width.

On-disk format (one uncompressed ``.npz``, written atomically; ``meta_json`` holds the scalars):

==================  ===============  ==========================================================
``token_ids``        [S] int32        token ids of all requests, concatenated
``request_offsets``  [R+1] int64      request r is ``token_ids[offsets[r]:offsets[r+1]]``
``routes``           [L, S, K] uint   top-k expert ids per occurrence, router order (best first)
``token_freq``       [V] int64        occurrences of each token id
``nn_source``        [V] int32        token whose statistics stand in for this one: itself if
                                      seen, its embedding nearest neighbour if extended, else -1
``counts_indptr``    [L, V+1] int64   CSR row pointers of the per-layer [V, N] count matrices
``counts_indices``   [nnz] int16/32   expert ids, all layers concatenated
``counts_data``      [nnz] int32      activation counts
``counts_nnz``       [L] int64        nonzeros per layer (split points of the two arrays above)
==================  ===============  ==========================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

import numpy as np
import scipy.sparse as sp

from megatron.common.cli import user_input
from moe_variants.semmoe.npz import load_npz, save_npz

__all__ = [
    "Profile",
    "profile_from_traces",
    "profile_from_arrays",
    "counts_from_routes",
    "extend_vocabulary",
    "split_profile",
    "save_profile",
    "load_profile",
]

PROFILE_FORMAT = "semmoe-profile"
PROFILE_VERSION = 1


def _route_dtype(num_experts: int) -> np.dtype:
    if num_experts <= 256:
        return np.dtype(np.uint8)
    return np.dtype(np.uint16) if num_experts <= 65536 else np.dtype(np.int32)


@dataclass
class Profile:
    """Per-layer routing statistics of a set of requests (see the module docstring for shapes)."""

    vocab_size: int
    num_experts: int
    top_k: int
    token_ids: np.ndarray  # [S] int32
    request_offsets: np.ndarray  # [R+1] int64
    routes: np.ndarray  # [L, S, K]
    counts: list[sp.csr_matrix]  # L x [V, N]
    token_freq: np.ndarray  # [V] int64
    nn_source: np.ndarray  # [V] int32
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.routes.shape[0]

    @property
    def num_requests(self) -> int:
        return len(self.request_offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def request_lengths(self) -> np.ndarray:
        """[R] int64 tokens per request."""
        return np.diff(self.request_offsets)

    def request_of_token(self) -> np.ndarray:
        """[S] int64 request index of every occurrence."""
        return np.repeat(np.arange(self.num_requests), self.request_lengths())

    def request_token_matrix(self) -> sp.csr_matrix:
        """[R, V] float64 CSR: occurrences of each token id in each request."""
        ones = np.ones(self.num_tokens)
        m = sp.csr_matrix((ones, (self.request_of_token(), self.token_ids)), shape=(self.num_requests, self.vocab_size))
        m.sum_duplicates()
        return m

    def confidence(self, layer: int) -> sp.csr_matrix:
        """[V, N] float64 CSR ``Cp``: row-normalised counts, Pr(expert | token) per activation (§3.2)."""
        c = self.counts[layer].astype(np.float64)
        row = np.asarray(c.sum(axis=1)).ravel()
        inv = np.divide(1.0, row, out=np.zeros_like(row), where=row > 0)
        return sp.csr_matrix(sp.diags(inv) @ c)

    def token_weights(self) -> np.ndarray:
        """[V] float64 ``a``: token frequency normalised to sum 1."""
        return self.token_freq / max(int(self.token_freq.sum()), 1)

    def select_requests(self, indices: np.ndarray) -> "Profile":
        """Profile of a subset of requests, in the given order; counts are recomputed from the routes
        (a vocabulary extension is dropped, since it referred to the full set's seen tokens) and the
        recorded ``request_ids`` are the selected requests'."""
        indices = np.asarray(indices, dtype=np.int64)
        lengths = self.request_lengths()[indices]
        starts = self.request_offsets[indices]
        occ = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(lengths.sum())
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        meta = dict(self.meta)
        if meta.get("request_ids") is not None:
            meta["request_ids"] = [meta["request_ids"][i] for i in indices]
        return profile_from_arrays(
            self.token_ids[occ], offsets, self.routes[:, occ], self.vocab_size, self.num_experts, meta
        )

    def validate(self) -> None:
        """Raise ``ValueError`` if the arrays are inconsistent with each other."""
        L, S, K = self.routes.shape if self.routes.ndim == 3 else (None, None, None)
        problems = []
        if self.routes.ndim != 3:
            problems.append(f"routes must be [L, S, K], got shape {self.routes.shape}")
        elif S != self.num_tokens or K != self.top_k:
            problems.append(f"routes shape {self.routes.shape} does not match S={self.num_tokens}, K={self.top_k}")
        if self.request_offsets[0] != 0 or self.request_offsets[-1] != self.num_tokens:
            problems.append("request_offsets must start at 0 and end at the number of tokens")
        if self.num_requests < 1 or np.any(np.diff(self.request_offsets) < 1):
            problems.append("every request needs at least one token")
        if self.num_tokens and (self.token_ids.min() < 0 or self.token_ids.max() >= self.vocab_size):
            problems.append(f"token ids outside [0, {self.vocab_size})")
        if self.num_tokens and int(self.routes.max()) >= self.num_experts:
            problems.append(f"expert ids outside [0, {self.num_experts})")
        if len(self.counts) != (L or 0):
            problems.append(f"{len(self.counts)} count matrices for {L} layers")
        if any(c.shape != (self.vocab_size, self.num_experts) for c in self.counts):
            problems.append("count matrices must be [V, N]")
        if self.token_freq.shape != (self.vocab_size,) or self.nn_source.shape != (self.vocab_size,):
            problems.append("token_freq and nn_source must be [V]")
        if problems:
            raise ValueError("invalid profile: " + "; ".join(problems))


def counts_from_routes(token_ids: np.ndarray, routes_l: np.ndarray, vocab_size: int, num_experts: int) -> sp.csr_matrix:
    """[V, N] int32 CSR of activation counts for one layer.

    token_ids: [S] token id per occurrence; routes_l: [S, K] expert ids chosen for it.
    """
    k = routes_l.shape[1]
    rows = np.repeat(token_ids.astype(np.int64), k)
    cols = routes_l.reshape(-1).astype(np.int64)
    m = sp.coo_matrix((np.ones(len(rows), dtype=np.int32), (rows, cols)), shape=(vocab_size, num_experts)).tocsr()
    m.sum_duplicates()
    return m


def profile_from_arrays(
    token_ids: np.ndarray,
    request_offsets: np.ndarray,
    routes: np.ndarray,
    vocab_size: int,
    num_experts: int,
    meta: dict | None = None,
) -> Profile:
    """Build a :class:`Profile` from concatenated arrays.

    token_ids: [S]; request_offsets: [R+1]; routes: [L, S, K] expert ids in router order.
    """
    token_ids = np.ascontiguousarray(token_ids, dtype=np.int32)
    routes = np.asarray(routes)
    if routes.ndim != 3:
        raise ValueError(f"routes must be [L, S, K], got shape {routes.shape}")
    if len(token_ids) and (int(routes.min()) < 0 or int(routes.max()) >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts})")
    if len(token_ids) and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    routes = routes.astype(_route_dtype(num_experts), copy=False)
    freq = np.bincount(token_ids, minlength=vocab_size).astype(np.int64)
    nn_source = np.where(freq > 0, np.arange(vocab_size), -1).astype(np.int32)
    p = Profile(
        vocab_size=int(vocab_size),
        num_experts=int(num_experts),
        top_k=int(routes.shape[2]),
        token_ids=token_ids,
        request_offsets=np.asarray(request_offsets, dtype=np.int64),
        routes=routes,
        counts=[counts_from_routes(token_ids, routes[l], vocab_size, num_experts) for l in range(routes.shape[0])],
        token_freq=freq,
        nn_source=nn_source,
        meta=dict(meta or {}),
    )
    p.validate()
    return p


def profile_from_traces(
    traces: Iterable[tuple[np.ndarray, np.ndarray]],
    vocab_size: int,
    num_experts: int,
    meta: dict | None = None,
) -> Profile:
    """Build a profile from per-request router traces.

    traces: iterable of ``(token_ids [S_r], topk [L, S_r, K])`` numpy pairs, one per request, with the
    top-k expert ids of every MoE layer in router order (highest score first). ``meta`` is stored
    as-is (e.g. ``{"model": ..., "hidden_size": ...}``; ``hidden_size`` feeds the byte estimate).
    """
    tok_list, route_list, lengths = [], [], []
    for i, (tok, topk) in enumerate(traces):
        tok, topk = np.asarray(tok), np.asarray(topk)
        if tok.ndim != 1 or topk.ndim != 3 or topk.shape[1] != tok.shape[0]:
            raise ValueError(f"trace {i}: expected token_ids [S] and topk [L, S, K], got {tok.shape} and {topk.shape}")
        if route_list and topk.shape[::2] != route_list[0].shape[::2]:
            raise ValueError(
                f"trace {i}: topk has L, K = {topk.shape[::2]}, earlier traces had {route_list[0].shape[::2]}"
            )
        if len(tok) == 0:
            raise ValueError(f"trace {i}: empty request")
        tok_list.append(tok)
        route_list.append(topk)
        lengths.append(len(tok))
    if not tok_list:
        raise ValueError("no traces given")
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return profile_from_arrays(
        np.concatenate(tok_list), offsets, np.concatenate(route_list, axis=1), vocab_size, num_experts, meta
    )


def extend_vocabulary(profile: Profile, embedding: np.ndarray, chunk_size: int = 4096) -> Profile:
    """Cover tokens never seen in the profile by their cosine nearest seen neighbour (paper §3.2).

    embedding: [V, H] input embedding table. Returns a copy whose ``nn_source[t]`` is the seen token
    closest to ``t`` for every unseen ``t`` (seen tokens keep themselves; zero embedding rows stay
    -1); the solver then gives ``t`` the tables of ``nn_source[t]``. Cost is O(V_unseen * V_seen * H)
    in chunks of ``chunk_size`` unseen rows.
    """
    embedding = np.asarray(embedding)
    if embedding.ndim != 2 or embedding.shape[0] < profile.vocab_size:
        raise ValueError(f"embedding must be [V>={profile.vocab_size}, H], got shape {embedding.shape}")
    emb = embedding[: profile.vocab_size].astype(np.float32)
    norms = np.linalg.norm(emb, axis=1)
    seen = np.flatnonzero(profile.token_freq > 0)
    unseen = np.flatnonzero((profile.token_freq == 0) & (norms > 0))
    nn_source = np.where(profile.token_freq > 0, np.arange(profile.vocab_size), -1).astype(np.int32)
    if len(seen) and len(unseen):
        seen_unit = emb[seen] / np.maximum(norms[seen], 1e-30)[:, None]
        for start in range(0, len(unseen), chunk_size):
            rows = unseen[start : start + chunk_size]
            sims = emb[rows] @ seen_unit.T  # [chunk, V_seen]; the query norm does not change the argmax
            nn_source[rows] = seen[np.argmax(sims, axis=1)]
    meta = dict(profile.meta, vocab_extended=int(len(unseen)))
    return replace(profile, nn_source=nn_source, meta=meta)


def split_profile(profile: Profile, fraction: float, seed: int = 0) -> tuple[Profile, Profile]:
    """Randomly split requests into (fraction, 1 - fraction) profiles, e.g. 20% to profile and 80%
    held out as in the paper. Both parts keep the original request order."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    r = profile.num_requests
    n_a = int(round(fraction * r))
    if n_a < 1 or n_a >= r:
        raise ValueError(f"cannot split {r} requests with fraction {fraction}: both parts need a request")
    perm = np.random.default_rng(seed).permutation(r)
    return profile.select_requests(np.sort(perm[:n_a])), profile.select_requests(np.sort(perm[n_a:]))


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write ``profile`` atomically to ``path`` (format in the module docstring)."""
    profile.validate()
    nnz = np.array([c.nnz for c in profile.counts], dtype=np.int64)
    idx_dtype = np.int16 if profile.num_experts <= 32767 else np.int32
    arrays = {
        "token_ids": profile.token_ids,
        "request_offsets": profile.request_offsets,
        "routes": profile.routes,
        "token_freq": profile.token_freq,
        "nn_source": profile.nn_source,
        "counts_indptr": np.stack([c.indptr.astype(np.int64) for c in profile.counts]),
        "counts_indices": np.concatenate([c.indices.astype(idx_dtype) for c in profile.counts]),
        "counts_data": np.concatenate([c.data.astype(np.int32) for c in profile.counts]),
        "counts_nnz": nnz,
    }
    meta = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "vocab_size": profile.vocab_size,
        "num_experts": profile.num_experts,
        "top_k": profile.top_k,
        "user": profile.meta,
    }
    save_npz(path, arrays, meta)


@user_input()
def load_profile(path: str | os.PathLike) -> Profile:
    """Read a profile written by :func:`save_profile`; a missing or corrupt file is a one-line ``UserError``."""
    required = (
        "token_ids", "request_offsets", "routes", "token_freq", "nn_source",
        "counts_indptr", "counts_indices", "counts_data", "counts_nnz",
    )  # fmt: skip
    a, meta = load_npz(path, PROFILE_FORMAT, required)
    if meta.get("version") != PROFILE_VERSION:
        raise ValueError(f"{path}: unsupported profile version {meta.get('version')} (expected {PROFILE_VERSION})")
    try:
        v, n = int(meta["vocab_size"]), int(meta["num_experts"])
        splits = np.concatenate([[0], np.cumsum(a["counts_nnz"])])
        counts = [
            sp.csr_matrix(
                (a["counts_data"][s:e], a["counts_indices"][s:e].astype(np.int32), a["counts_indptr"][l]), shape=(v, n)
            )
            for l, (s, e) in enumerate(zip(splits[:-1], splits[1:]))
        ]
        p = Profile(
            vocab_size=v,
            num_experts=n,
            top_k=int(meta["top_k"]),
            token_ids=a["token_ids"],
            request_offsets=a["request_offsets"],
            routes=a["routes"],
            counts=counts,
            token_freq=a["token_freq"],
            nn_source=a["nn_source"],
            meta=dict(meta.get("user", {})),
        )
        p.validate()
    except (KeyError, ValueError, IndexError) as e:
        raise ValueError(f"{path}: corrupt profile file ({str(e).splitlines()[0]})") from None
    return p
