"""Online data scheduling from the Sem-MoE tables (paper App. B, Algorithms 2 and 3).

* Attention-DP (Algorithm 2): a request goes to the DP rank its tokens vote for (``T``/``Tp``
  summed over layers), with a rotating mask so that every D consecutive requests cover all D ranks.
* Attention-TP (Algorithm 3): before each MoE layer every token gets a predicted device (``T`` by
  token id, or ``A`` by the devices it was routed to in the previous layers, whichever is more
  confident); tokens are stably grouped by device with equal per-rank slices, and the permutation
  is fused into the reduce-scatter that follows attention (shuffled reduce-scatter) and inverted
  inside the all-gather after the MoE (shuffled all-gather).

Shape legend: ``n`` tokens in a batch (all TP ranks hold the same ``n`` tokens before the
reduce-scatter), ``W`` TP/EP ranks, ``n_local = n / W``, ``H`` hidden, ``K`` top-k, ``N`` experts,
``V`` vocabulary, ``L`` layers, ``D`` devices (= W), ``B`` segments (requests) in a batch.

The pure functions take explicit tensors; the collectives take an explicit process group.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron.common import collectives

from .tables import Tables

__all__ = [
    "RequestScheduler",
    "request_device_scores",
    "choose_dp_rank",
    "DPRequestScheduler",
    "schedule_requests",
    "request_scheduler",
    "routed_devices",
    "context_index",
    "predict_token_devices",
    "align_to_ranks",
    "rebatch_permutation",
    "inverse_permutation",
    "pad_assignment",
    "assign_tokens",
    "rebatch_tokens",
    "resume_tokens",
    "shuffle_local",
    "shuffled_reduce_scatter",
    "shuffled_all_gather",
]


# ---------------------------------------------------------------------------------------------
# Algorithm 2: attention-DP request scheduling (numpy; runs in the request scheduler process)
# ---------------------------------------------------------------------------------------------


def request_device_scores(
    token_ids: np.ndarray, token2device: np.ndarray, token2device_conf: np.ndarray, num_devices: int
) -> np.ndarray:
    """[D] affinity of a request to each device (Alg. 2 line 3): the confidence-weighted votes of
    its tokens' table entries over all layers. token_ids: [n]; token2device, token2device_conf: [L, V]."""
    token_ids = np.asarray(token_ids, dtype=np.int64)
    vocab = token2device.shape[1]
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab}) to match the tables")
    votes = token2device[:, token_ids]  # [L, n]
    conf = token2device_conf[:, token_ids]
    ok = votes >= 0
    return np.bincount(votes[ok].astype(np.int64), weights=conf[ok].astype(np.float64), minlength=num_devices)


def choose_dp_rank(scores: np.ndarray, available: np.ndarray) -> tuple[int, np.ndarray]:
    """Alg. 2 lines 4-8: best-scoring device among those still available in this round; returns
    the device and the next round's availability mask (all available again once every device got
    a request). scores: [D]; available: [D] bool."""
    masked = np.where(available, scores, -np.inf)
    dev = int(np.argmax(masked))
    nxt = available.copy()
    nxt[dev] = False
    if not nxt.any():
        nxt[:] = True
    return dev, nxt


class DPRequestScheduler:
    """Stateful Algorithm 2 for an online scheduler: ``assign(token_ids) -> rank`` per arriving request."""

    def __init__(self, tables: Tables):
        if not tables.has_schedule:
            raise ValueError(f"tables of method {tables.method!r} carry no token table to schedule requests with")
        self.tables = tables
        self.available = np.ones(tables.num_devices, dtype=bool)

    def assign(self, token_ids: np.ndarray) -> int:
        t = self.tables
        scores = request_device_scores(token_ids, t.token2device, t.token2device_conf, t.num_devices)
        dev, self.available = choose_dp_rank(scores, self.available)
        return dev


def schedule_requests(requests: Sequence[np.ndarray], tables: Tables) -> np.ndarray:
    """[R] DP rank of each request, scheduled in the given (arrival) order by Algorithm 2."""
    sched = DPRequestScheduler(tables)
    return np.array([sched.assign(r) for r in requests], dtype=np.int64)


@dataclasses.dataclass
class RequestScheduler:
    """Algorithm 2 as a batch scheduler for an inference application: ``self(token_lists) -> [R]
    ranks`` (``megatron.training.lm_eval_adapter.MegatronCheckpointLM(request_scheduler=...)``).
    ``name`` and ``report()`` describe it in the application's results."""

    tables: Tables
    source: Optional[str] = None  # the tables' directory
    name: str = "semmoe-algorithm-2"

    def __post_init__(self):
        if not self.tables.has_schedule:
            raise ValueError(f"tables of method {self.tables.method!r} carry no token table to schedule requests with")

    def __call__(self, token_lists: Sequence[Sequence[int]]) -> np.ndarray:
        return schedule_requests([np.asarray(t, dtype=np.int64) for t in token_lists], self.tables)

    def report(self) -> dict:
        return {"semmoe_tables": os.path.abspath(self.source)} if self.source else {}

    def online(self):
        """Algorithm 2 for a server's loop: ``f(prompt token ids, outstanding per rank) -> rank``,
        one request at a time in arrival order (the rotating mask: every D consecutive requests
        cover all D ranks, so assigned counts differ by at most one). Token ids the tables do not
        cover (a prompt is user input) cast no vote."""
        sched = DPRequestScheduler(self.tables)
        vocab = self.tables.token2device.shape[1]

        def assign(prompt, outstanding) -> int:
            ids = np.asarray(prompt, dtype=np.int64)
            return sched.assign(ids[(ids >= 0) & (ids < vocab)])

        return assign


def request_scheduler(tables: Tables, source: Optional[str] = None) -> RequestScheduler:
    """Algorithm 2 over ``tables`` (from the directory ``source``) as a request scheduler."""
    return RequestScheduler(tables, source)


# ---------------------------------------------------------------------------------------------
# Algorithm 3: attention-TP token re-batching (torch; runs inside the model)
# ---------------------------------------------------------------------------------------------


def routed_devices(topk: torch.Tensor, expert2device: torch.Tensor) -> torch.Tensor:
    """[n] device holding most of each token's top-k experts (ties: the better-ranked expert's).

    topk: [n, K] expert ids in router order; expert2device: [N]. This is the per-layer device a
    token was routed to, the symbol of the 2-gram sequence table A.
    """
    dev = expert2device[topk.long()]  # [n, K]
    same = (dev[:, :, None] == dev[:, None, :]).sum(-1)  # [n, K] votes for each slot's device
    best = torch.argmax(same, dim=1)  # first maximum = best-ranked expert among the tied devices
    return dev.gather(1, best[:, None]).squeeze(1)


def context_index(prev_devices: torch.Tensor, num_devices: int) -> torch.Tensor:
    """[n] row of the sequence table: prev_devices [n, lookback] with column j = layer l-1-j."""
    weights = num_devices ** torch.arange(prev_devices.shape[1], device=prev_devices.device)
    return (prev_devices.long() * weights).sum(1)


def predict_token_devices(
    token_ids: torch.Tensor,
    num_devices: int,
    token2device: torch.Tensor,
    token2device_conf: torch.Tensor,
    seq2device: torch.Tensor | None = None,
    seq2device_conf: torch.Tensor | None = None,
    prev_devices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 3 line 2 for one layer: ``where(Tp[tok] > Ap[ctx], T[tok], A[ctx])``.

    token_ids: [n]; token2device, token2device_conf: [V] (this layer's rows); seq2device,
    seq2device_conf: [D**lookback]; prev_devices: [n, lookback] routed devices of the previous
    layers (column 0 = layer l-1), or None for the first layers. Returns predicted device [n]
    (-1 = no prediction) and its confidence [n].
    """
    ids = token_ids.long()
    t, tp = token2device[ids].long(), token2device_conf[ids].float()
    if seq2device is None or prev_devices is None:
        return t, tp
    ctx = context_index(prev_devices, num_devices)
    a, ap = seq2device[ctx].long(), seq2device_conf[ctx].float()
    use_token = tp > ap
    return torch.where(use_token, t, a), torch.where(use_token, tp, ap)


def align_to_ranks(
    pred: torch.Tensor, conf: torch.Tensor, num_ranks: int, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """Alg. 3 lines 4-5 ("group by key, align"): final device per token with equal per-rank slices.

    pred: [n] predicted device (-1 = none), conf: [n]; lengths: [B] segment (request) lengths,
    tokens segment-major (default: one segment). Each segment gives each rank at most
    ``cap = ceil(len / W)`` tokens (exactly len / W when divisible). Tokens without a prediction
    take their natural slice ``pos // cap``; within a (segment, device) group the most confident
    ``cap`` tokens stay (ties: earlier position), the overflow fills the remaining free slots in
    position order, lowest device first. Returns assigned device [n].
    """
    n, w = pred.numel(), num_ranks
    dev = pred.device
    if lengths is None:
        lengths = torch.tensor([n], device=dev)
    lengths = lengths.long()
    num_seg = lengths.numel()
    seg = torch.repeat_interleave(torch.arange(num_seg, device=dev), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(n, device=dev) - starts[seg]
    cap = (lengths + w - 1) // w
    pred = torch.where(pred < 0, pos // cap[seg], pred.long())

    # Sort by (segment, device, -confidence, position): stable sorts, least significant key first.
    order = torch.argsort(-conf.float(), stable=True)
    order = order[torch.argsort(pred[order], stable=True)]
    order = order[torch.argsort(seg[order], stable=True)]
    key = seg[order] * w + pred[order]
    idx = torch.arange(n, device=dev)
    first = torch.ones(n, dtype=torch.bool, device=dev)
    first[1:] = key[1:] != key[:-1]
    group_start = torch.cummax(torch.where(first, idx, torch.zeros_like(idx)), 0).values
    rank = torch.empty_like(idx)
    rank[order] = idx - group_start
    kept = rank < cap[seg]

    assigned = torch.where(kept, pred, torch.full_like(pred, -1))
    overflow = torch.nonzero(~kept).squeeze(1)  # segment-major, position order
    if overflow.numel():
        kept_count = torch.bincount(seg[kept] * w + pred[kept], minlength=num_seg * w).view(num_seg, w)
        free = (cap[:, None] - kept_count).clamp_min(0)  # [B, W]
        slot_dev = torch.repeat_interleave(torch.arange(w, device=dev).repeat(num_seg), free.reshape(-1))
        free_start = torch.cumsum(free.sum(1), 0) - free.sum(1)
        ov_seg = seg[overflow]
        ov_count = torch.bincount(ov_seg, minlength=num_seg)
        ov_start = torch.cumsum(ov_count, 0) - ov_count
        within = torch.arange(overflow.numel(), device=dev) - ov_start[ov_seg]
        assigned[overflow] = slot_dev[free_start[ov_seg] + within]
    return assigned


def rebatch_permutation(assigned: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Alg. 3 lines 3 and 6: [n] stable permutation grouping tokens by assigned device; after
    ``x[perm]`` rank r's slice is ``[r * n/W, (r+1) * n/W)``. Needs n % W == 0 and an aligned
    assignment (each rank exactly n / W tokens)."""
    n = assigned.numel()
    if n % num_ranks:
        raise ValueError(f"{n} tokens cannot be split evenly over {num_ranks} ranks")
    counts = torch.bincount(assigned.long(), minlength=num_ranks)
    if counts.numel() != num_ranks or bool((counts != n // num_ranks).any()):
        raise ValueError(f"assignment is not aligned: per-rank counts {counts.tolist()}, expected {n // num_ranks}")
    return torch.argsort(assigned.long(), stable=True)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """[n] inverse of ``perm`` (Alg. 3 line 11): ``x[perm][inverse_permutation(perm)] == x``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


def pad_assignment(assigned: torch.Tensor, num_ranks: int, total: Optional[int] = None) -> torch.Tensor:
    """[total] device per token after appending ``total - n`` padding tokens to an aligned
    assignment [n] (default ``total = W * ceil(n / W)``; the engine may pad further).

    ``assigned`` gives each rank at most ``ceil(n / W)`` tokens (``align_to_ranks``); the pads
    fill the remaining slots, lowest rank first, so that every rank gets exactly ``total / W``
    rows and the real tokens keep their devices."""
    n = assigned.numel()
    total = num_ranks * -(-n // num_ranks) if total is None else int(total)
    if total % num_ranks or total < n:
        raise ValueError(f"{total} rows cannot hold {n} tokens in {num_ranks} equal slices")
    counts = torch.bincount(assigned.long(), minlength=num_ranks)
    free = total // num_ranks - counts
    if bool((free < 0).any()):
        raise ValueError(f"assignment is not aligned: per-rank counts {counts.tolist()}, at most {total // num_ranks}")
    pads = torch.repeat_interleave(torch.arange(num_ranks, device=assigned.device), free)
    return torch.cat([assigned.long(), pads])


def assign_tokens(
    token_ids: torch.Tensor,
    tables: Tables,
    layer: int,
    prev_devices: torch.Tensor | None = None,
    num_real: Optional[int] = None,
) -> torch.Tensor:
    """Alg. 3 lines 2-5 for one TP batch before MoE layer ``layer``: the device [n] of each token.

    The first ``num_real`` tokens (default all ``n``) are predicted (``T``/``A``) and aligned to at
    most ``ceil(num_real / W)`` per rank; the rest (the engine's padding) fill the free slots
    (:func:`pad_assignment`). Tables without a token table (the contiguous and EPLB baselines)
    predict nothing, which gives the natural contiguous slices (the sequence-parallel split).
    prev_devices: [n, lookback] routed devices of the previous layers, or None."""
    n = token_ids.numel()
    m = n if num_real is None else max(0, min(int(num_real), n))
    w = tables.num_devices
    ids = token_ids.reshape(-1)[:m]
    if tables.has_schedule:
        as_t = lambda x: torch.as_tensor(x[layer], device=ids.device)  # noqa: E731
        use_seq = prev_devices is not None and layer >= tables.lookback
        pred, conf = predict_token_devices(
            ids,
            w,
            as_t(tables.token2device),
            as_t(tables.token2device_conf),
            as_t(tables.seq2device) if use_seq else None,
            as_t(tables.seq2device_conf) if use_seq else None,
            prev_devices[:m] if use_seq else None,
        )
    else:
        pred = torch.full((m,), -1, dtype=torch.long, device=ids.device)
        conf = torch.zeros(m, device=ids.device)
    return pad_assignment(align_to_ranks(pred, conf, w), w, total=n)


def rebatch_tokens(
    token_ids: torch.Tensor,
    tables: Tables,
    layer: int,
    prev_devices: torch.Tensor | None = None,
    num_real: Optional[int] = None,
) -> torch.Tensor:
    """Alg. 3 ``rebatch_tokens``: predict, align (:func:`assign_tokens`) and return the shuffle
    permutation [n] for the tokens of one TP batch before MoE layer ``layer``."""
    return rebatch_permutation(assign_tokens(token_ids, tables, layer, prev_devices, num_real), tables.num_devices)


def resume_tokens(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Alg. 3 ``resume_tokens``: restore the original order of ``x`` [n, ...] given ``x = y[perm]``."""
    return x.index_select(0, inverse_permutation(perm))


def shuffle_local(perm: torch.Tensor, rank: int, world_size: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-token metadata (positions, request ids, ...) for this rank's slice after a shuffled
    reduce-scatter. Metadata is replicated on all TP ranks, so no communication is needed: each
    tensor [n, ...] -> [n_local, ...] rows ``perm[rank*n_local : (rank+1)*n_local]``."""
    n_local = perm.numel() // world_size
    rows = perm[rank * n_local : (rank + 1) * n_local]
    return tuple(t.index_select(0, rows) for t in tensors)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    collectives.reduce_scatter_tensor(out, inp, group=group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    collectives.all_gather_into_tensor(out, inp, group=group)


class _ShuffledReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, perm, group):
        world = dist.get_world_size(group)
        if x.shape[0] % world:
            raise ValueError(f"{x.shape[0]} tokens cannot be reduce-scattered over {world} ranks")
        ctx.group = group
        ctx.save_for_backward(perm)
        send = x.index_select(0, perm)  # the shuffle is the gather that fills the send buffer
        out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
        _reduce_scatter(out, send, group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (perm,) = ctx.saved_tensors
        world = dist.get_world_size(ctx.group)
        full = grad_out.new_empty((grad_out.shape[0] * world, *grad_out.shape[1:]))
        _all_gather(full, grad_out.contiguous(), ctx.group)
        grad_x = torch.empty_like(full)
        grad_x.index_copy_(0, perm, full)
        return grad_x, None, None


class _ShuffledAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, perm, group):
        world = dist.get_world_size(group)
        ctx.group = group
        ctx.save_for_backward(perm)
        full = x_local.new_empty((x_local.shape[0] * world, *x_local.shape[1:]))
        _all_gather(full, x_local.contiguous(), group)
        out = torch.empty_like(full)
        out.index_copy_(0, perm, full)  # the un-shuffle is the scatter out of the receive buffer
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (perm,) = ctx.saved_tensors
        world = dist.get_world_size(ctx.group)
        send = grad_out.index_select(0, perm)
        grad_local = grad_out.new_empty((grad_out.shape[0] // world, *grad_out.shape[1:]))
        _reduce_scatter(grad_local, send, ctx.group)
        return grad_local, None, None


def shuffled_reduce_scatter(x: torch.Tensor, perm: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Shuffled reduce-scatter (SRS): ``reduce_scatter(x[perm])`` over ``group``.

    x: [n, ...] this rank's partial sums (the attention output before the TP reduction); perm: [n]
    from :func:`rebatch_permutation`, identical on all ranks. Returns [n_local, ...]: the summed
    rows ``perm[rank*n_local:(rank+1)*n_local]``. The permutation is applied while filling the
    send buffer, so the shuffle costs no extra pass. Backward is the shuffled all-gather adjoint.
    """
    return _ShuffledReduceScatter.apply(x, perm, group)


def shuffled_all_gather(x_local: torch.Tensor, perm: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Shuffled all-gather (SAG): all-gather the MoE outputs and undo ``perm`` while copying out.

    x_local: [n_local, ...] (rows in the SRS order); returns [n, ...] in the original token order,
    the inverse of :func:`shuffled_reduce_scatter`'s shuffle. Backward follows Megatron's
    sequence-parallel convention (all-gather <-> reduce-scatter).
    """
    return _ShuffledAllGather.apply(x_local, perm, group)
